"""forksafe_fuzz_target: one fuzz target, built two ways.

  <name>_test    a cc_test (default toolchain, default suite) that replays the seed corpus and
                 the regressions through the entry point (replay_test.cc).
  <name>_fuzzer  the libFuzzer binary; only with --config=fuzz (clang), see tools/fuzz.sh.
"""

def forksafe_fuzz_target(name, src, deps = [], size = "small"):
    data = native.glob(["corpus/%s/**" % name, "regressions/%s/**" % name])
    native.cc_test(
        name = name + "_test",
        size = size,
        srcs = [src, "replay_test.cc", "fuzz_target.h"],
        copts = ["-DFORKSAFE_FUZZ_TARGET=\\\"%s\\\"" % name],
        data = data,
        deps = deps + ["@forksafe_system//:gtest", "//mp:codec", "//runtime:error", "//tests:support"],
    )
    native.cc_binary(
        name = name + "_fuzzer",
        srcs = [src, "fuzz_target.h"],
        linkopts = ["-fsanitize=fuzzer"],
        deps = deps + ["//mp:codec", "//runtime:error"],
        tags = ["manual"],
        testonly = True,
    )
