"""Print engine_bench.py --json results as one markdown table (bench/engine_settings.sh writes them).

    python bench/engine_table.py OUTDIR/*.json
    python bench/engine_table.py OUTDIR          (a directory: its *.json files)

One row per file: the model file and setting, our ISA (simd / host), the threads, the paired ratios ours/peer of
decode and prefill, T ours and the peer's, V(4)/T ours (the peer's), and the load average around
the run. A run without the peer shows "-" in the ratio columns.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def row(path: Path) -> str:
    r = json.loads(path.read_text())
    if not isinstance(r, dict):
        raise TypeError(f"the top level is a JSON {type(r).__name__}, not an object")
    p, rat = r.get("peer"), r.get("ratios")
    setting = f"{Path(r['model']).name}, depth {r['depth']}"
    if r["prompt_tokens"] != 128:
        setting += f", {r['prompt_tokens']}-token prefill"
    if p and p.get("flash_attn"):
        setting += ", peer with flash attention"
    isa = f"{r['simd']} ({r.get('host_isa', '?')} host), {r['threads']} thr"

    def ratio(key: str) -> str:
        return f"{rat[key]:.2f}x" if rat else "-"

    t = f"{r['T_ms']:.2f}" + (f" ({p['T_ms']:.2f})" if p else "")
    v4 = r["verify_ratio"].get("4")
    v4s = "-" if v4 is None else f"{v4:.2f}" + (f" ({p['verify_ratio']['4']:.2f})" if p else "")
    load = "-".join(f"{x:.1f}" for x in r["loadavg_1m"])
    return (f"| {setting} | {isa} | {ratio('decode_tok_s')} | {t} | {v4s} | {ratio('prefill_tok_s')} "
            f"| {r['rounds']} | {load} |")


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    paths = []
    for a in argv:
        p = Path(a)
        if p.is_dir():
            found = sorted(p.glob("*.json"))
            if not found:
                print(f"engine_table: no .json files in {p}", file=sys.stderr)
                return 2
            paths += found
        elif p.is_file():
            paths.append(p)
        else:
            print(f"engine_table: {p}: no such file or directory", file=sys.stderr)
            return 2
    rows = []
    for p in paths:
        try:
            rows.append(row(p))
        except UnicodeDecodeError as e:
            print(f"engine_table: {p} is not an engine_bench.py --json result (not UTF-8 text: byte {e.start})",
                  file=sys.stderr)
            return 2
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            why = f"{type(e).__name__}: {e}"
            why = why if len(why) <= 200 else why[:200] + "..."
            print(f"engine_table: {p} is not an engine_bench.py --json result ({why})", file=sys.stderr)
            return 2
    print("| file / setting | our ISA | decode vs llama.cpp | T ms ours (llama.cpp) | V(4)/T ours (llama.cpp) "
          "| prefill vs llama.cpp | rounds | load |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(r)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
