"""
How large the specification is (issue 56 item 1): compress.py's lines and code lines, section by
section, and its longest functions.

    python -m nanogeo.lab.spec_size [FILE]        (default: the repository's compress.py)

A code line is a line that is not blank, not a comment and not part of a docstring (the first
string of the module, a class or a function); a section begins at a "# ==== N." banner and the
header is what comes before the first. A function's length is its def's lines, docstring
included, to its last (the count tests/test_compress.py holds to 30, and step() to 40).
"""
import ast
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SECTION = re.compile(r"# ==== \d+\. ")


def docstring_lines(tree):
    """The line numbers of every docstring in the parsed module (not the line of its def or
    class, where it begins on that line: a def and its docstring on one line are code)."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                lines.update(range(first.lineno, first.end_lineno + 1))
                lines.discard(getattr(node, "lineno", None))
    return lines


def code_lines(source):
    """The 1-based numbers of the source's code lines."""
    docs = docstring_lines(ast.parse(source))
    return [i for i, line in enumerate(source.splitlines(), 1)
            if line.strip() and not line.strip().startswith("#") and i not in docs]


def function_lengths(source):
    """[(lines, qualified name)] of every function and method, a def's first line to its last
    (e.g. "Communicator.step"), in the order they appear."""
    lengths = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lengths.append((child.end_lineno - child.lineno + 1, prefix + child.name))
            named = isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            visit(child, prefix + child.name + "." if named else prefix)

    visit(ast.parse(source), "")
    return lengths


def sections(source):
    """[(title, lines, code lines)]: the header, then each "# ==== N." section."""
    lines, code = source.splitlines(), set(code_lines(source))
    starts = [(0, "header")] + [(i, line[len("# ==== "):].rstrip("= ")[:44])
                                for i, line in enumerate(lines) if SECTION.match(line)]
    ends = [start for start, _ in starts[1:]] + [len(lines)]
    return [(title, end - start, sum(start < n <= end for n in code))
            for (start, title), end in zip(starts, ends)]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    path = argv[0] if argv else os.path.join(ROOT, "compress.py")
    with open(path) as f:
        source = f.read()
    print(f"{os.path.basename(path)}: {len(source.splitlines())} lines, "
          f"{len(code_lines(source))} code lines")
    for title, n_lines, n_code in sections(source):
        print(f"  {title:44s} {n_lines:5d} lines {n_code:4d} code lines")
    longest = sorted(function_lengths(source), reverse=True)[:3]
    print("longest functions: " + ", ".join(f"{name} {n}" for n, name in longest))


if __name__ == "__main__":
    main()
