"""cc_whole_archive: the C++ libraries of `deps`, every object of them linked (--whole-archive).

A cc_binary(linkshared = True) links only the objects of its dependencies that something it
already has refers to, as a static link does. For libforksafe.so that would leave out parts of
the API that nothing inside the library calls (Queue, Lock, Value, DLPack...). Depending on this
rule instead of on the libraries marks each of their static archives alwayslink, so that the
shared library holds all of them.

Link flags of the form -l:libNAME.a (Debian's static Abseil and libatomic archives, which
//third_party/system links into executables to keep forks cheap) become -lNAME: Debian compiled
those archives as position-dependent (PIE) code, which cannot go into a shared library, so the
shared library depends on their shared forms (libabsl_*.so.20220623, libatomic.so.1) instead.
Abseil's symbols are then neither defined in nor exported by the library.
"""

load("@bazel_tools//tools/cpp:toolchain_utils.bzl", "find_cpp_toolchain")

def _shared_form(flag):
    # "-l:libabsl_strings.a" -> "-labsl_strings"; any other flag unchanged.
    if flag.startswith("-l:lib") and flag.endswith(".a"):
        return "-l" + flag[len("-l:lib"):-len(".a")]
    return flag

def _cc_whole_archive_impl(ctx):
    cc_toolchain = find_cpp_toolchain(ctx)
    feature_configuration = cc_common.configure_features(
        ctx = ctx,
        cc_toolchain = cc_toolchain,
        requested_features = ctx.features,
        unsupported_features = ctx.disabled_features,
    )
    merged = cc_common.merge_cc_infos(cc_infos = [dep[CcInfo] for dep in ctx.attr.deps])
    linker_inputs = []
    for linker_input in merged.linking_context.linker_inputs.to_list():
        libraries = []
        for library in linker_input.libraries:
            if library.static_library or library.pic_static_library:
                library = cc_common.create_library_to_link(
                    actions = ctx.actions,
                    feature_configuration = feature_configuration,
                    cc_toolchain = cc_toolchain,
                    static_library = library.static_library,
                    pic_static_library = library.pic_static_library,
                    alwayslink = True,
                )
            libraries.append(library)
        linker_inputs.append(cc_common.create_linker_input(
            owner = linker_input.owner,
            libraries = depset(libraries),
            user_link_flags = depset([_shared_form(flag) for flag in linker_input.user_link_flags]),
            additional_inputs = depset(linker_input.additional_inputs),
        ))
    return [CcInfo(
        compilation_context = merged.compilation_context,
        linking_context = cc_common.create_linking_context(linker_inputs = depset(linker_inputs)),
    )]

cc_whole_archive = rule(
    implementation = _cc_whole_archive_impl,
    attrs = {
        "deps": attr.label_list(providers = [CcInfo]),
        "_cc_toolchain": attr.label(default = "@bazel_tools//tools/cpp:current_cc_toolchain"),
    },
    fragments = ["cpp"],
    toolchains = ["@bazel_tools//tools/cpp:toolchain_type"],
    doc = "The libraries of deps with every object linked (alwayslink), for a shared library.",
)
