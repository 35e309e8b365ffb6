#!/usr/bin/python3
"""One definition per name: fails when two files of the library define a class, struct, union or
enum of the same fully qualified name (outside anonymous namespaces). Two such definitions are an
ODR violation: they may not compile together, and when they do not meet in one translation unit
the linker keeps one of their inline members for both (issue 12: two mp::internal::SharedBlock
classes; an unoptimized build linked the arena's data() into Array and crashed).

Usage: one_definition.py FILE...   (headers and sources; exit status 1 listing each duplicate)
"""
import re
import sys

CLASS_HEAD = re.compile(
    r"(?:^|[\s;])(?:template\s*<[^{};]*>\s*)?(class|struct|union|enum(?:\s+class|\s+struct)?)\s+"
    r"(?:\[\[[^\]]*\]\]\s*)?(?:alignas\([^)]*\)\s*)?(\w+)\s*(?:final\s*)?(?::(?!:)[^;{}]*)?$")
NAMESPACE_HEAD = re.compile(r"(?:^|[\s;])(inline\s+)?namespace\s*([\w:]*)\s*(\[\[[^\]]*\]\]\s*)?$")


def strip(text):
    """Removes comments, string/char literals and preprocessor lines, keeping line breaks."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append("\n" * text.count("\n", i, j))
            i = j
        elif c == '"' or c == "'":
            m = re.match(r'R"([^(]*)\(', text[i - 1:i + 20]) if i > 0 and text[i - 1] == "R" else None
            if m:
                end = text.find(")" + m.group(1) + '"', i)
                end = n if end < 0 else end + len(m.group(1)) + 2
            else:
                end = i + 1
                while end < n and text[end] != c:
                    end += 2 if text[end] == "\\" else 1
                end += 1
            out.append(" " + "\n" * text.count("\n", i, end))
            i = end
        elif c == "#" and (i == 0 or text[text.rfind("\n", 0, i) + 1:i].strip() == ""):
            j = i
            while True:  # the directive, with its continuation lines
                k = text.find("\n", j)
                if k < 0:
                    j = n
                    break
                if text[k - 1] == "\\":
                    j = k + 1
                    continue
                j = k
                break
            out.append("\n" * text.count("\n", i, j))
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


def definitions(path):
    text = strip(open(path, encoding="utf-8", errors="replace").read())
    stack = []  # ("ns", name) | ("anon",) | ("other",)
    last = 0  # start of the current statement head
    for i, c in enumerate(text):
        if c in ";":
            last = i + 1
        elif c == "}":
            if stack:
                stack.pop()
            last = i + 1
        elif c == "{":
            head = text[last:i]
            m = NAMESPACE_HEAD.search(head)
            if m:
                name = m.group(2)
                stack.append(("ns", name) if name else ("anon",))
            else:
                if all(s[0] == "ns" for s in stack):
                    cm = CLASS_HEAD.search(head)
                    if cm and not head.rstrip().endswith(")"):
                        ns = "::".join(s[1] for s in stack)
                        line = text.count("\n", 0, i) + 1
                        yield f"{ns}::{cm.group(2)}", line
                stack.append(("other",))
            last = i + 1


def main(files):
    seen = {}
    for f in files:
        for name, line in definitions(f):
            seen.setdefault(name, []).append(f"{f}:{line}")
    dups = {k: v for k, v in seen.items() if len({p.rsplit(":", 1)[0] for p in v}) > 1}
    for name, where in sorted(dups.items()):
        sys.stderr.write(f"{name} is defined more than once: {', '.join(where)}; rename one "
                         "(one definition per name, docs/reliability.md)\n")
    print(f"{len(seen)} names checked in {len(files)} files, {len(dups)} defined twice")
    return 1 if dups else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
