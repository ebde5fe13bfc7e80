"""`python -m sglang_ext` is `python -m sglang_ext.launch`."""

from __future__ import annotations

import sys

from sglang_ext.launch import main

if __name__ == "__main__":
    sys.exit(main())
