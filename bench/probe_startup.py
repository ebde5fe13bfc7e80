"""Where a preset worker's 'tokenizer' startup stage spends its time on this machine (the GPU machine
logged 7-11 s against 1.5 s on the CPU machine): transformers' import, AutoTokenizer, the default model.

    python bench/probe_startup.py            # the AutoTokenizer path, with a profile of from_pretrained
    python bench/probe_startup.py --worker   # the worker's path since 2026-12-06 (Tokenizer.from_dir)
Run in a fresh process each time: the imports are what is timed. Results: bench/results/2026-12-06-h100-s3."""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time


def main() -> None:
    t0 = time.perf_counter()
    import transformers

    t1 = time.perf_counter()
    from transformers import AutoTokenizer

    t2 = time.perf_counter()
    from sglang_ext.models.default_model import ensure_default_model

    path = ensure_default_model()
    t3 = time.perf_counter()
    prof = cProfile.Profile()
    prof.enable()
    AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    prof.disable()
    t4 = time.perf_counter()
    print(f"import transformers {t1 - t0:.2f} s, AutoTokenizer attr {t2 - t1:.2f} s, "
          f"default model {t3 - t2:.2f} s, from_pretrained {t4 - t3:.2f} s; python {sys.version.split()[0]}, "
          f"transformers {transformers.__version__}")
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(30)
    print(s.getvalue())


def worker_path() -> None:
    """torch first (a worker has it loaded before its tokenizer stage), then what load_tokenizer does."""
    import torch  # noqa: F401

    t0 = time.perf_counter()
    from sglang_ext.models.default_model import ensure_default_model
    from sglang_ext.worker.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(ensure_default_model())
    t1 = time.perf_counter()
    print(f"worker tokenizer stage {t1 - t0:.2f} s ({type(tok.hf).__name__}, "
          f"auto factory imported: {'transformers.models.auto.auto_factory' in sys.modules})")


if __name__ == "__main__":
    worker_path() if "--worker" in sys.argv[1:] else main()
