"""Run an SGLang frontend program file (unchanged user code) in this interpreter, with two import
shims the CPU test environment needs; usage: `python tests/frontend/run_program.py PROGRAM.py ARGS...`.

Why shims: `import sglang` (0.5.23) runs transformers patches written for transformers 5.x (the
project pins 4.57), imports triton at module level (a large GPU compiler wheel) and IPython's
`display` (notebook output). The frontend needs none of them: sglang skips its patches when
transformers is absent, uses no triton attribute at import, and calls `display` only in notebook
helpers. So, in this process only, `transformers` is hidden, and an empty `triton` and a minimal
`IPython.display` stand in when the real ones are not installed. The program runs exactly as written.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import runpy
import sys
import types


class _Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if name == "transformers" or name.startswith("transformers."):
            raise ModuleNotFoundError(f"No module named {name!r} (hidden from the sglang frontend)", name=name)
        return None


def install_shims() -> None:
    sys.meta_path.insert(0, _Hide())
    if importlib.util.find_spec("triton") is None:
        sys.modules["triton"] = types.ModuleType("triton")
    if importlib.util.find_spec("IPython") is None:
        ipython, display = types.ModuleType("IPython"), types.ModuleType("IPython.display")
        display.HTML = str  # type: ignore[attr-defined]
        display.display = print  # type: ignore[attr-defined]
        ipython.display = display  # type: ignore[attr-defined]
        sys.modules.update({"IPython": ipython, "IPython.display": display})


if __name__ == "__main__":
    install_shims()
    program = sys.argv[1]
    sys.argv = sys.argv[1:]
    runpy.run_path(program, run_name="__main__")
