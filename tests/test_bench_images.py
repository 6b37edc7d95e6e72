"""The image benchmarks' input and requests (not a timed test): `echospec bench` workloads with an
``image`` field (files read and put before the last user message's text, bad ones refused naming
the line), bench/image_bench.py's rendered workloads (deterministic from their seeds, a JSONL
`echospec bench` reads), and its `--quick --json` run on the tiny Qwen3-VL fixture, whose output
is checked for structure only: no speed is asserted."""
from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench" / "image_bench.py"
ECHOSPEC = [sys.executable, "-m", "echospec.cli"]


def _png(tmp_path: Path, name: str = "a.png") -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (64, 48), (10, 20, 30)).save(buf, "PNG")
    (tmp_path / name).write_bytes(buf.getvalue())
    return buf.getvalue()


def test_workload_image_goes_before_the_last_user_text(tmp_path):
    from echospec import cli
    png = _png(tmp_path)
    (tmp_path / "sub").mkdir()
    f = tmp_path / "sub" / "w.jsonl"
    f.write_text(json.dumps({"id": "one", "image": "../a.png", "messages": [
        {"role": "user", "content": "first"}, {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "Read it."}]}) + "\n" +
        json.dumps({"id": "two", "image": [str(tmp_path / "a.png"), "../a.png"],
                    "messages": [{"role": "user", "content": [{"type": "text", "text": "Both?"}]}]}) + "\n")
    one, two = cli._load_workloads(str(f))
    assert one["messages"][0]["content"] == "first" and one["messages"][1]["content"] == "ok"
    assert one["messages"][2]["content"] == [{"type": "image", "image": png, "media_type": "image/png"},
                                             {"type": "text", "text": "Read it."}]
    assert [p["type"] for p in two["messages"][0]["content"]] == ["image", "image", "text"]


@pytest.mark.parametrize("fields, message", [
    ({"image": "a.png", "prompt": "x"}, "image needs messages with a user message"),
    ({"image": "a.png", "messages": [{"role": "system", "content": "x"}]}, "image needs messages with a user"),
    ({"image": 5, "messages": [{"role": "user", "content": "x"}]}, "image must be an image file's path"),
    ({"image": [], "messages": [{"role": "user", "content": "x"}]}, "image must be an image file's path"),
    ({"image": ["a.png"] * 17, "messages": [{"role": "user", "content": "x"}]}, "a list of 1 to 16 paths"),
    ({"image": "none.png", "messages": [{"role": "user", "content": "x"}]}, "none.png: No such file"),
    ({"image": "w.jsonl", "messages": [{"role": "user", "content": "x"}]}, "not a PNG, JPEG, WebP or GIF"),
])
def test_bad_workload_image_is_refused_naming_the_line(tmp_path, fields, message):
    _png(tmp_path)
    f = tmp_path / "w.jsonl"
    f.write_text('{"id": "ok", "prompt": "x"}\n' + json.dumps({"id": "bad", **fields}) + "\n")
    r = subprocess.run([*ECHOSPEC, "bench", "--workloads", str(f), "--target", "127.0.0.1:1"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 2 and f"{f}:2: " in r.stderr and message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_written_workloads_are_deterministic_and_load(tmp_path):
    from echospec import cli
    outs = []
    for d in ("a", "b"):
        r = subprocess.run([sys.executable, str(BENCH), "--write-workloads", str(tmp_path / d), "--max-tokens", "12"],
                           capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert r.returncode == 0, r.stderr
        outs.append(Path(r.stdout.strip()))
    assert outs[0] == tmp_path / "a" / "images.jsonl"
    ws = cli._load_workloads(str(outs[0]))
    assert [w["id"] for w in ws] == ["image_text", "image_table", "image_objects"]
    for w in ws:
        assert w["max_tokens"] == 12 and w["kind"] == w["id"]
        image, text = w["messages"][-1]["content"]
        assert image["media_type"] == "image/png" and text["type"] == "text"
        # the same seed, the same pixels: both runs wrote the same files
        assert image["image"] == (tmp_path / "b" / f"{w['id']}.png").read_bytes()
        # a rendered image, not a blank one
        px = Image.open(io.BytesIO(image["image"])).convert("L")
        lo, hi = px.getextrema()
        assert hi - lo > 100


def test_renderers_depend_on_the_seed():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import image_bench
    finally:
        sys.path.remove(str(ROOT / "bench"))
    for kind, fn in image_bench.RENDERERS.items():
        (a, ta), (b, tb) = fn(1), fn(2)
        assert a != b and ta != tb, kind
        assert fn(1) == (a, ta), kind
    png, names = image_bench.render_objects(5, 64, 96)
    assert Image.open(io.BytesIO(png)).size == (64, 96)
    assert 3 <= len(names.splitlines()) <= 5


def test_image_bench_quick_json():
    r = subprocess.run([sys.executable, str(BENCH), "--quick", "--json", "--threads", "1"],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert out["model"] == "qwen3vl-Q8_0.gguf" and out["mmproj"] == "qwen3vl-mmproj-F16.gguf"
    t = out["ttft"]
    assert len(t["rounds"]) == 1 and t["image"] == "objects, 320x320"
    assert t["turn1_ttft_ms"] > 0 and t["turn2_ttft_ms"] > 0
    assert t["ratio_median"] == pytest.approx(t["turn2_ttft_ms"] / t["turn1_ttft_ms"], rel=1e-3)
    # turn 1: a fresh image, nothing reused; 320x320 is 10 x 10 merged image tokens
    assert t["turn1_cached_prompt_tokens"] == 0 and t["turn1_prompt_tokens"] > 100
    # turn 2 reuses at least turn 1's whole prompt, the image included
    assert t["turn2_prompt_tokens"] > t["turn2_cached_prompt_tokens"] >= t["turn1_prompt_tokens"]
    w = out["workloads"]
    assert [x["id"] for x in w["rows"]] == ["image_text", "image_table", "image_objects"]
    assert w["identical"] == w["of"] == 3
    for x in w["rows"]:
        assert x["identical"] and x["spec_enabled"] and x["tokens"] == 8
        assert x["hits"] + x["kv_rolls"] == x["draft_tokens"] and x["off_s"] > 0 and x["on_s"] > 0
        assert x["off_prefill_ms"] > 0 and x["on_prefill_ms"] > 0


@pytest.mark.parametrize("args, message", [
    (["--ttft-size", "320"], "--ttft-size must be WxH"),
    (["--rounds", "0"], "--rounds must be >= 1"),
    (["--mmproj", "no-such.gguf"], "--mmproj no-such.gguf: no such file"),
])
def test_image_bench_bad_arguments(args, message):
    r = subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_echospec_bench_private_stack_with_mmproj(tmp_path):
    """`echospec bench --mmproj` gives its private stack the projector: the rendered workloads run
    spec off and on with the same output; --mmproj with --target is refused."""
    r = subprocess.run([sys.executable, str(BENCH), "--write-workloads", str(tmp_path)], capture_output=True,
                       text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    jsonl = r.stdout.strip()
    fixture = ROOT / "tests" / "data" / "models"
    r = subprocess.run([*ECHOSPEC, "bench", "--workloads", jsonl, "--model", str(fixture / "qwen3vl-Q8_0.gguf"),
                        "--mmproj", str(fixture / "qwen3vl-mmproj-F16.gguf"), "--threads", "1",
                        "--max-tokens", "6", "--json"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [x["id"] for x in rows] == ["image_text", "image_table", "image_objects"]
    assert all(x["identical"] and x["on"]["tokens"] == 6 for x in rows)
    assert all(x["off"]["prefill_ms"] > 0 for x in rows)
    r = subprocess.run([*ECHOSPEC, "bench", "--workloads", jsonl, "--target", "127.0.0.1:1", "--mmproj",
                        str(fixture / "qwen3vl-mmproj-F16.gguf")], capture_output=True, text=True, timeout=60,
                       cwd=ROOT)
    assert r.returncode == 2 and "--mmproj applies to a private stack" in r.stderr, r.stderr
    r = subprocess.run([*ECHOSPEC, "bench", "--workloads", jsonl, "--model", str(fixture / "qwen3vl-Q8_0.gguf"),
                        "--mmproj", str(tmp_path / "none.gguf")], capture_output=True, text=True, timeout=60,
                       cwd=ROOT)
    assert r.returncode == 2 and "none.gguf: no such file" in r.stderr, r.stderr


def test_image_bench_projector_of_another_model_is_a_clear_error():
    r = subprocess.run([sys.executable, str(BENCH), "--quick", "--model",
                        str(ROOT / "tests" / "data" / "models" / "gemma3-Q8_0.gguf")],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 1 and "image_bench: verifier: --mmproj" in r.stderr, r.stderr
    assert "takes no image embeddings" in r.stderr and "Traceback" not in r.stderr
