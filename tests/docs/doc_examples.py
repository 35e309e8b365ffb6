#!/usr/bin/python3
"""Extracts every C++ code block of the given Markdown files into one C++ file, so that a test
can compile and link them (//tests/docs:doc_examples_test). Every example in the docs must compile.

The rules (also in docs/building.md, "Examples in the docs are compiled"):
  - Every fenced code block has a language: ```cpp (or ```c++) is C++ and is compiled; anything
    else (```sh, ```text, ```python, ...) is not. A fence with no language is an error, so that
    no C++ example escapes by accident.
  - An HTML comment right before a C++ block (invisible in the rendered page) says how to compile
    it; without one the block is a whole file (declarations at namespace scope):
        <!-- doc-example: file -->                     the default
        <!-- doc-example: statements -->               statements: wrapped in a function
        <!-- doc-example: statements(int n, Pool& p) -->   ...whose parameters are these
        <!-- doc-example: skip <reason> -->             not compiled (the reason is required)
    Lines of the comment after the first are prelude code, placed before the block (stand-ins
    for the reader's own functions and types the example calls).
  - Each block is compiled in a namespace of its own, with every #include hoisted to the top, and
    sees `namespace fr = forksafe::runtime; namespace fd = forksafe::device;
    namespace mp = forksafe::mp;` (the aliases the guide uses). `int main(` is renamed, so that
    complete programs compile side by side.

Usage: tests/docs/doc_examples.py OUT.cc FILE.md...
Exit status 1, with file:line, for a block that breaks the rules.
"""
import re
import sys

FENCE = re.compile(r"^(\s*)```(.*)$")
DIRECTIVE = re.compile(r"^\s*<!--\s*doc-example:\s*(.*?)\s*(-->)?\s*$")


def blocks(path):
    """Yields (line, language, code_lines, directive, prelude_lines) for each fenced block."""
    lines = open(path, encoding="utf-8").read().split("\n")
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang = m.group(1), m.group(2).strip()
        start = i
        i += 1
        code = []
        while i < len(lines) and not re.match(r"^\s*```\s*$", lines[i]):
            code.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        i += 1  # closing fence
        # The directive: the nearest non-blank lines before the fence, if they are our comment.
        directive, prelude = None, []
        j = start - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        if j >= 0 and lines[j].strip().endswith("-->"):
            k = j
            while k >= 0 and "<!--" not in lines[k]:
                k -= 1
            if k >= 0:
                dm = DIRECTIVE.match(lines[k])
                if dm:
                    directive = dm.group(1)
                    body = lines[k + 1:j + 1]
                    if k != j:
                        body[-1] = body[-1].replace("-->", "")
                        prelude = [l for l in body]
                    else:
                        directive = directive.replace("-->", "").strip()
        yield start + 1, lang, code, directive, prelude


def main(argv):
    out_path, md_files = argv[1], argv[2:]
    includes, bodies, errors = [], [], []
    count = 0
    for md in md_files:
        for line, lang, code, directive, prelude in blocks(md):
            where = f"{md}:{line}"
            if not lang:
                errors.append(f"{where}: code block without a language; write ```cpp for C++ "
                              "(compiled) or ```text / ```sh / ... for anything else")
                continue
            if lang.lower() not in ("cpp", "c++"):
                if directive is not None:
                    errors.append(f"{where}: doc-example comment before a ```{lang} block")
                continue
            mode = (directive or "file").strip()
            if mode.startswith("skip"):
                if not mode[4:].strip():
                    errors.append(f"{where}: doc-example: skip needs a reason")
                continue
            params = None
            if mode.startswith("statements"):
                pm = re.match(r"statements\s*(\((.*)\))?\s*$", mode)
                if not pm:
                    errors.append(f"{where}: malformed doc-example directive: {mode}")
                    continue
                params = pm.group(2) or ""
            elif mode != "file":
                errors.append(f"{where}: unknown doc-example mode {mode!r} (file, statements, "
                              "statements(params), skip <reason>)")
                continue
            ns = re.sub(r"\W", "_", f"doc_{md}_{line}")
            text = []
            for l in prelude + ["// ---- the example ----"] + code:
                if re.match(r"^\s*#\s*include\b", l):
                    if l.strip() not in includes:
                        includes.append(l.strip())
                    text.append("")  # keep line numbers close
                else:
                    text.append(re.sub(r"\bint main\s*\(", "int DocMain(", l))
            body = [f"// {where}", f"namespace {ns} {{"]
            if params is not None:
                split = text.index("// ---- the example ----")
                body += text[:split] + [f"void Example({params}) {{"] + text[split:] + ["}"]
            else:
                body += text
            body += [f"}}  // namespace {ns}", ""]
            bodies.append("\n".join(body))
            count += 1
    if errors:
        sys.stderr.write("\n".join(errors) + "\n")
        return 1
    with open(out_path, "w", encoding="utf-8") as out:
        out.write("// Generated by tests/docs/doc_examples.py from the docs' C++ blocks. Do not edit.\n")
        for inc in includes:
            out.write(inc + "\n")
        out.write("\nnamespace fr = forksafe::runtime;\nnamespace fd = forksafe::device;\n"
                  "namespace mp = forksafe::mp;\nnamespace runtime = forksafe::runtime;\n"
                  "namespace device = forksafe::device;\n\n")
        out.write("\n".join(bodies))
        out.write(f"\nint main() {{ return {count} > 0 ? 0 : 1; }}  // {count} examples compiled\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
