"""cc_headers_only: the headers (and include paths) of C++ libraries, without their objects.

The Python extension (//python) compiles against forksafe's headers and links libforksafe.so,
the process's one forksafe: depending on //:forksafe itself would link a second, static copy
into the extension.
"""

def _cc_headers_only_impl(ctx):
    merged = cc_common.merge_cc_infos(cc_infos = [dep[CcInfo] for dep in ctx.attr.deps])
    return [CcInfo(compilation_context = merged.compilation_context)]

cc_headers_only = rule(
    implementation = _cc_headers_only_impl,
    attrs = {"deps": attr.label_list(providers = [CcInfo])},
    provides = [CcInfo],
    doc = "The compilation context of `deps` (headers, include paths, defines), no linking.",
)
