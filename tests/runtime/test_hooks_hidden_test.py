#!/usr/bin/python3
# tests/runtime/test_hooks_hidden_test.py: libforksafe.so exports no test or benchmark hook.
#
# The library's version script (tools/forksafe.map) exports every symbol of namespace forksafe
# with the glob forksafe::*, and a glob of `local` loses to it: a hook (a function named
# ...ForTest, ...ForTesting or ...ForBenchmark, which switches fork safety off or holds an
# internal lock) is hidden only by its exact name in the `local` section. This test reads the
# declarations of runtime/, device/ and mp/ and fails when a hook is not listed there, so that a
# new hook cannot ship in the shared library's API unnoticed. It checks names, not signatures: a
# listed name whose parameters changed hides nothing, and the linker does not say so. After
# `bazel build //:libforksafe.so`, `nm -DC --defined-only bazel-bin/libforksafe.so | grep -E
# 'For(Test|Testing|Benchmark)\('` must print nothing.
#
# Arguments: the version script, then the source files.
import re
import sys

HOOK = re.compile(r"\b(\w+For(?:Test|Testing|Benchmark))\s*\(")


def hidden_names(version_script):
    """The function names listed exactly (quoted) in the script's `local:` section."""
    text = re.sub(r"/\*.*?\*/", "", version_script, flags=re.S)
    local = text.split("local:", 1)[1] if "local:" in text else ""
    names = set()
    for quoted in re.findall(r'"([^"]+)"', local):
        m = re.search(r"(\w+)\(", quoted)
        if m:
            names.add(m.group(1))
    return names


def main():
    script_path, sources = sys.argv[1], sys.argv[2:]
    with open(script_path) as f:
        hidden = hidden_names(f.read())
    hooks = {}
    for path in sources:
        if not path.endswith(".h"):
            continue
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if line.lstrip().startswith("//"):
                    continue
                for name in HOOK.findall(line):
                    hooks.setdefault(name, "%s:%d" % (path, n))
    if not hooks:
        print("no hook found in %d sources: the scan is broken" % len(sources))
        return 1
    missing = sorted(set(hooks) - hidden)
    for name in missing:
        print("%s: test hook %s is exported by libforksafe.so: list it by its demangled name "
              "in the local: section of tools/forksafe.map" % (hooks[name], name))
    print("%d hooks declared, %d hidden by the version script, %d missing"
          % (len(hooks), len(set(hooks) & hidden), len(missing)))
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
