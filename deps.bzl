"""forksafe_dependencies(): the repositories forksafe builds with, for its own WORKSPACE and yours.

An outside workspace needs only (docs/building.md, "The package"):

    local_repository(name = "forksafe", path = "/path/to/forksafe")
    load("@forksafe//:deps.bzl", "forksafe_dependencies")
    forksafe_dependencies()

then depends on @forksafe//:forksafe (everything) or on a layer (@forksafe//mp:pool, ...).

Everything is offline (Debian 12 packages; nothing is downloaded):
  rules_java             Debian's bazel-rules-java at /usr/share/bazel/rules/java
  rules_cc               forksafe's shim (third_party/rules_cc): Debian's bazel-rules-cc is too
                         new for Bazel 4.2.3; the shim forwards to the native C++ rules
  remote_coverage_tools  forksafe's stand-in (third_party/remote_coverage_tools), for `bazel test`
  forksafe_system        Debian's libraries under /usr (third_party/system/BUILD.system)
  forksafe_local_cuda    the CUDA Toolkit's driver headers, if any (third_party/cuda)

A repository the workspace already defines (before the call) is left alone: a consumer's own
rules_cc or rules_java wins. forksafe's own repositories carry a forksafe_ prefix so that they
never clobber a consumer's "@system" or "@local_cuda" (repository names are global in WORKSPACE
mode). Paths into forksafe's tree are labels, so they resolve wherever forksafe is checked out.
"""

load("//third_party/cuda:cuda_configure.bzl", "cuda_configure")

def _local_tree_impl(ctx):
    # The repository is the folder holding `marker`, linked file by file.
    folder = ctx.path(ctx.attr.marker).dirname
    for child in folder.readdir():
        ctx.symlink(child, child.basename)

_local_tree = repository_rule(
    implementation = _local_tree_impl,
    attrs = {"marker": attr.label(mandatory = True, allow_single_file = True)},
    local = True,
    doc = "A local_repository whose folder is given by a label (a file in it), not a path.",
)

def _defined(name):
    return native.existing_rule(name) != None

def forksafe_dependencies():
    """Defines the repositories forksafe needs that the workspace has not defined yet."""
    if not _defined("rules_java"):
        native.local_repository(
            name = "rules_java",
            path = "/usr/share/bazel/rules/java",
        )
    if not _defined("rules_cc"):
        _local_tree(
            name = "rules_cc",
            marker = Label("//third_party/rules_cc:WORKSPACE"),
        )
    if not _defined("remote_coverage_tools"):
        _local_tree(
            name = "remote_coverage_tools",
            marker = Label("//third_party/remote_coverage_tools:WORKSPACE"),
        )
    if not _defined("forksafe_system"):
        native.new_local_repository(
            name = "forksafe_system",
            path = "/usr",
            build_file = str(Label("//third_party/system:BUILD.system")),
        )
    if not _defined("forksafe_local_cuda"):
        cuda_configure(name = "forksafe_local_cuda")
