"""Images and audio in (issue 36): gem4's vision and audio towers against llama.cpp's mtmd on the same weights, and
what an image costs a chat turn end to end. Not part of CI.

    python benchmarks/multimodal.py make                                    # towers + mmproj files, benchmarks/out/
    python benchmarks/multimodal.py encode --llama-bin DIR --repeats 3      # image encode per budget, both engines
    python benchmarks/multimodal.py audio --llama-bin DIR --repeats 3       # a 10 s clip, both engines
    python benchmarks/multimodal.py ttft --repeats 3                        # gem4 serve: image turn vs text turn

DIR holds llama.cpp's `llama-mtmd-cli` (built from the llama-cpp-python 0.3.36 sdist's vendor/llama.cpp, README
"Multimodal"); `$GEM4_LLAMA_BIN` is the default. Every step takes `--threads` (2) for both engines.

- make: two towers at their real sizes with seeded random weights (norms 1 + 0.1 N(0, 1), matrices N(0, 1/fan_in),
  E2B's clip bounds +-4): the E2B/E4B one (D 768, 16 layers, 12 heads of 64, MLP 3072, clipped linears) and the
  26B/31B one (D 1152, 27 layers, 16 heads of 72, MLP 4304, standardized), each projecting into 1536, the width of
  the E2B-shaped text file both engines load beside it (llama-mtmd-cli needs a text model of the projection's
  width; the projection is under 1 % of a tower's work). Each is written as an HF checkpoint piece
  (`mm-<shape>-hf/`: config.json and the towers' `model.*` tensors in bf16) and as llama.cpp's mmproj GGUF by
  gem4's writer (`mmproj-<shape>-<type>.gguf`, what `gem4 convert` writes, byte for byte what llama.cpp's converter
  writes: tests/test_mmproj.py), so both engines read the same file. The E2B piece also holds the audio tower
  (12 conformer layers, D 1024); with `--llama-cpp-src` (`$GEM4_LLAMA_CPP`: llama.cpp's source with
  convert_hf_to_gguf.py and gguf-py) llama.cpp's converter writes `mmproj-e2b-audio-<type>.gguf` from the piece,
  since gem4's mmproj files hold no audio tower.
- encode: one picture (2048 x 1536, smooth random) at each budget, interleaved gem4, llama.cpp, gem4, ...: gem4 binds
  the tower from the mmproj (`--dtype`, bfloat16 as `gem4 serve` runs it) and times `VisionModel.encode` on the
  preprocessed patches, after one warm-up encode; llama.cpp runs `llama-mtmd-cli` on the E2B-shaped text file and
  the picture (`--image-max-tokens B`) and reports "mtmd batch encoding done in N ms" (its context warms up at load;
  a second image in the same run encodes no faster). Both time the tower and projection only, not decoding or
  resizing the picture. Medians, min-max.
- audio: a 10 s chirp as a 16 kHz WAV; gem4's AudioModel from the piece's tensors (log-mel front end + conformer +
  projection: the engine's encode_audio) against llama-mtmd-cli's encode time on llama.cpp's audio mmproj.
- ttft: `gem4 serve` on the E2B-shaped text file with the E2B-shaped mmproj, one chat request at a time
  (non-streamed, max_tokens 1: its wall time is the time to the first token), per repeat: a text-only turn with as
  many prompt tokens as the image turn, a turn with one picture at budget 280 (a PNG data URI; decoding, resizing,
  encoding and prefill all count) and a question, and a second question about the same picture (the prefix cache
  holds the picture's K/V). Each repeat uses a new picture and new words (cold), the server is warmed by one of each
  first. Reported: TTFT medians, image/text and second/first ratios against the issue's targets (1.2 and 0.2).

Raw runs go to benchmarks/out/multimodal-<step>.json.
"""
from __future__ import annotations

import argparse
import base64
import io
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
import wave
from pathlib import Path

import numpy as np

import gem4  # noqa: F401  first: gem4 sets torch's runtime environment
import torch

OUT = Path(__file__).resolve().parent / "out"
TEXT = OUT / "e2b-q4_0.gguf"
TEXT_WIDTH = 1536
TOKEN_IDS = dict(boi_token_id=255999, eoi_token_id=258882, image_token_id=258880, video_token_id=258884,
                 boa_token_id=256000, eoa_token_id=258883, audio_token_id=258881)
# the real towers (transformers' Gemma4VisionConfig defaults; the 26B/31B values of the released configs)
SHAPES = {
    "e2b": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=16, num_attention_heads=12,
                num_key_value_heads=12, head_dim=64, use_clipped_linears=True, standardize=False),
    "31b": dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                num_key_value_heads=16, head_dim=72, use_clipped_linears=False, standardize=True),
}
VISION_COMMON = dict(model_type="gemma4_vision", hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
                     rope_parameters={"rope_theta": 100.0, "rope_type": "default"}, pooling_kernel_size=3,
                     patch_size=16, position_embedding_size=10240, default_output_length=280)
BUDGETS = (70, 280, 1120)
PICTURE = (1536, 2048)          # (height, width): larger than every budget, so both engines scale it down
ENCODED = re.compile(r"mtmd batch encoding done in (\d+) ms")        # llama-mtmd-cli's line for one media item


# ---- the towers ----

def vision_config(shape: str):
    from gem4.config import build_vision_config
    v = SHAPES[shape]
    return build_vision_config(
        hidden_size=v["hidden_size"], intermediate_size=v["intermediate_size"], num_layers=v["num_hidden_layers"],
        num_heads=v["num_attention_heads"], num_kv_heads=v["num_key_value_heads"], head_dim=v["head_dim"],
        patch_size=VISION_COMMON["patch_size"], pooling=VISION_COMMON["pooling_kernel_size"],
        position_embedding_size=VISION_COMMON["position_embedding_size"], rope_theta=100.0, rms_norm_eps=1e-6,
        clipped_linears=v["use_clipped_linears"], standardize=v["standardize"], text_hidden_size=TEXT_WIDTH,
        bidirectional=False, image_token_id=TOKEN_IDS["image_token_id"], boi_token_id=TOKEN_IDS["boi_token_id"],
        eoi_token_id=TOKEN_IDS["eoi_token_id"], video_token_id=TOKEN_IDS["video_token_id"])


def random_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Seeded random weights that keep a random tower finite: norms near 1, clip bounds +-4, N(0, 1/fan_in)."""
    if name.endswith(("input_min", "output_min")):
        return torch.full(shape, -4.0)
    if name.endswith(("input_max", "output_max")):
        return torch.full(shape, 4.0)
    if "norm" in name or name.endswith("std_scale"):
        return 1 + 0.1 * torch.randn(shape, generator=gen)
    if name.endswith("std_bias") or len(shape) < 2:
        return 0.1 * torch.randn(shape, generator=gen)
    if name.endswith("position_embedding_table"):
        return 0.02 * torch.randn(shape, generator=gen)
    return torch.randn(shape, generator=gen) / float(np.prod(shape[1:])) ** 0.5


def random_state(module: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: random_tensor(name, tuple(p.shape), gen).to(torch.bfloat16 if p.ndim >= 2 else torch.float32)
            for name, p in module.named_parameters()}


def audio_module():
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from audio import E2B_AUDIO, audio_config  # the E2B/E4B conformer's shape, shared with benchmarks/audio.py

    from gem4.model.audio import AudioModel
    with torch.device("meta"):
        return AudioModel(audio_config()), E2B_AUDIO


def hf_config(shape: str, audio: dict | None) -> dict:
    """config.json of the piece: enough for llama.cpp's converter (its mmproj side) and for a reader."""
    text = {"model_type": "gemma4_text", "hidden_size": TEXT_WIDTH, "num_hidden_layers": 35,
            "use_bidirectional_attention": "vision" if shape == "31b" else None}
    config = {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4", "dtype": "bfloat16",
              "text_config": text, "vision_config": {**VISION_COMMON, **SHAPES[shape]}, **TOKEN_IDS,
              "eoa_token_index": TOKEN_IDS["eoa_token_id"]}
    config["audio_config"] = None if audio is None else {"model_type": "gemma4_audio", "hidden_act": "silu", **audio}
    return config


def cmd_make(a: argparse.Namespace) -> None:
    from safetensors.torch import save_file

    from gem4.model.vision import VisionModel
    from gem4.weights.checkpoint import Checkpoint, TensorEntry
    from gem4.weights.mmproj import write_mmproj

    OUT.mkdir(parents=True, exist_ok=True)
    for shape in a.shapes:
        t0 = time.perf_counter()
        config = vision_config(shape)
        with torch.device("meta"):
            skeleton = VisionModel(config)
        state = random_state(skeleton, seed=36 + len(shape) + config.num_layers)
        audio = None
        if shape == "e2b":
            module, audio = audio_module()
            audio_state = random_state(module, seed=3600)
            audio_state = {k: (v.float() if k.endswith(("_min", "_max")) else v) for k, v in audio_state.items()}
        piece = OUT / f"mm-{shape}-hf"
        piece.mkdir(exist_ok=True)
        tensors = {"model." + k: v.contiguous() for k, v in state.items()}
        if audio is not None:
            tensors.update({"model." + k: v.contiguous() for k, v in audio_state.items()})
        save_file(tensors, str(piece / "model.safetensors"), metadata={"format": "pt"})
        (piece / "config.json").write_text(json.dumps(hf_config(shape, audio), indent=2) + "\n")
        (piece / "processor_config.json").write_text(json.dumps(      # llama.cpp's converter reads mean/std here
            {"image_processor": {"image_mean": [0.0, 0.0, 0.0], "image_std": [1.0, 1.0, 1.0]}}))
        del tensors
        entries = {name: TensorEntry(name, tuple(t.shape), "BF16", t.numel() * t.element_size(),
                                     (lambda t=t: t)) for name, t in state.items()}
        ckpt = Checkpoint(path=piece, format="safetensors", config=None, tensors={}, towers=entries,
                          tower_configs={"vision": config})
        out = OUT / f"mmproj-{shape}-{a.type}.gguf"
        counts = write_mmproj(ckpt, out, a.type, name=f"gem4 benchmark {shape}-shaped tower")
        n = sum(t.numel() for t in state.values())
        print(f"{shape}: {n / 1e6:.0f}M vision parameters -> {out.name} ({out.stat().st_size / 1e6:.0f} MB, "
              f"{counts}), piece {piece.name}/ ({time.perf_counter() - t0:.0f} s)", flush=True)
        del state, entries, ckpt
        if audio is not None and a.llama_cpp_src:
            aout = OUT / f"mmproj-e2b-audio-{a.type}.gguf"
            env = dict(os.environ, PYTHONPATH=str(Path(a.llama_cpp_src) / "gguf-py"), PYTHONDONTWRITEBYTECODE="1")
            done = subprocess.run([sys.executable, str(Path(a.llama_cpp_src) / "convert_hf_to_gguf.py"), str(piece),
                                   "--mmproj", "--outtype", a.type, "--outfile", str(aout)], env=env,
                                  capture_output=True, text=True)
            if done.returncode:
                sys.exit(f"llama.cpp's converter failed on {piece}:\n{done.stderr[-3000:]}")
            from gem4.gguf import GGUFReader
            with GGUFReader(out) as ours, GGUFReader(aout) as theirs:
                same = all(theirs.tensors[n].ggml_type == info.ggml_type
                           and np.array_equal(theirs.tensor_data(n),
                                              ours.tensor_data(n)) for n, info in ours.tensors.items())
            print(f"e2b audio (+ vision) by llama.cpp's converter -> {aout.name} ({aout.stat().st_size / 1e6:.0f} MB; "
                  f"its vision tensors {'are' if same else 'are NOT'} {out.name}'s, byte for byte)", flush=True)


# ---- llama.cpp ----

def llama_bin(a: argparse.Namespace, tool: str) -> str:
    if not a.llama_bin:
        sys.exit("--llama-bin DIR (or $GEM4_LLAMA_BIN) is needed: the directory with llama.cpp's " + tool)
    path = Path(a.llama_bin) / tool
    if not os.access(path, os.X_OK):
        sys.exit(f"{path} is not an executable")
    return str(path)


def mtmd_run(a: argparse.Namespace, mmproj: Path, media: Path, extra: list[str]) -> float:
    """llama-mtmd-cli on `media` (its one encode, seconds). --jinja: the file's Gemma 4 template needs it."""
    cmd = [llama_bin(a, "llama-mtmd-cli"), "-m", str(a.text), "--mmproj", str(mmproj), "--image", str(media),
           "-p", "Describe it.", "-n", "1", "--temp", "0", "-t", str(a.threads), "-tb", str(a.threads), "-c", "4096",
           "--jinja", *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    log = done.stdout + done.stderr
    if done.returncode:
        raise RuntimeError(f"llama-mtmd-cli exited {done.returncode}:\n{log[-3000:]}")
    encoded = [int(m.group(1)) / 1000 for m in ENCODED.finditer(log)]
    if len(encoded) != 1:
        raise RuntimeError(f"expected one encode time from llama-mtmd-cli, got {encoded}:\n{log[-3000:]}")
    return encoded[0]


# ---- encode ----

def saved_args(a: argparse.Namespace) -> dict:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items() if k != "func"}


def picture(seed: int):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from vision_fixtures import sample_image       # a smooth random picture (what the tests resize)
    return sample_image(*PICTURE, seed=seed)


def summary(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"


def cmd_encode(a: argparse.Namespace) -> None:
    from gem4.media.image import preprocess
    from gem4.model.backends import choose
    from gem4.weights.checkpoint import open_checkpoint
    from gem4.weights.towers import bind_vision

    torch.set_num_threads(a.threads)
    image = picture(seed=0)
    path = OUT / "multimodal-picture.png"
    image.save(path)
    rows = []
    for shape in a.shapes:
        mmproj = OUT / f"mmproj-{shape}-{a.type}.gguf"
        if not mmproj.exists():
            sys.exit(f"{mmproj} is missing: run `python benchmarks/multimodal.py make --type {a.type}` first")
        ckpt = open_checkpoint(a.text, mmproj)
        dtype = getattr(torch, a.dtype)
        tower = bind_vision(ckpt, dtype, "cpu", choose(dtype, "cpu"))     # the backend gem4.load chooses
        ckpt.close()
        cfg = tower.config
        items = {b: preprocess(image, b, patch_size=cfg.patch_size, pooling=cfg.pooling) for b in a.budgets}
        for b, item in items.items():
            tower.encode(item.patches, item.positions, item.grid)                       # warm-up, once per size
        runs = {(b, e): [] for b in a.budgets for e in ("gem4", "llama.cpp")}
        tokens = {}
        for r in range(a.repeats):
            for b, item in items.items():
                t0 = time.perf_counter()
                tower.encode(item.patches, item.positions, item.grid)
                runs[b, "gem4"].append(time.perf_counter() - t0)
                if not a.no_llama:
                    runs[b, "llama.cpp"].append(mtmd_run(a, mmproj, path, ["--image-max-tokens", str(b)]))
                tokens[b] = item.num_tokens
                print(f"{shape} repeat {r} budget {b}: gem4 {runs[b, 'gem4'][-1]:.3f} s"
                      + (f", llama.cpp {runs[b, 'llama.cpp'][-1]:.3f} s" if not a.no_llama else ""), flush=True)
        del tower
        for b in a.budgets:
            rows.append({"shape": shape, "budget": b, "tokens": tokens[b], "gem4": runs[b, "gem4"],
                         "llama.cpp": runs[b, "llama.cpp"]})
        (OUT / "multimodal-encode.json").write_text(json.dumps({"args": saved_args(a),
                                                                 "rows": rows}, indent=1))
    print(f"\nimage encode (tower + projection), {PICTURE[1]}x{PICTURE[0]} picture, gem4 {a.dtype} / mmproj "
          f"{a.type}, {a.threads} threads, medians of {a.repeats} (min-max), seconds\n")
    print("| tower | budget | soft tokens | gem4 | llama.cpp | gem4 / llama.cpp |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        ll = row["llama.cpp"]
        ratio = statistics.median(row["gem4"]) / statistics.median(ll) if ll else float("nan")
        print(f"| {row['shape']} | {row['budget']} | {row['tokens']} | {summary(row['gem4'])} | "
              f"{summary(ll) if ll else '-'} | {ratio:.2f} |")


# ---- audio ----

def chirp(seconds: float, rate: int = 16000) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.4 * np.sin(2 * np.pi * (200 + 300 * t) * t)
            + 0.05 * np.random.default_rng(0).standard_normal(t.size)).astype(np.float32)


def cmd_audio(a: argparse.Namespace) -> None:
    from gem4.media import audio as front_end
    from gem4.model.audio import encode_audio
    from gem4.model.backends import choose
    from gem4.weights.audio import bind_audio
    from gem4.weights.checkpoint import open_checkpoint

    torch.set_num_threads(a.threads)
    clip = chirp(a.seconds)
    path = OUT / f"multimodal-chirp-{a.seconds:g}s.wav"
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(front_end.SAMPLE_RATE)
        w.writeframes((np.clip(clip, -1, 1) * 32767).astype("<i2").tobytes())
    clip = (np.frombuffer(path.read_bytes()[44:], "<i2") / 32768).astype(np.float32)       # what llama.cpp reads
    mmproj = OUT / f"mmproj-e2b-audio-{a.type}.gguf"
    if not mmproj.exists():
        sys.exit(f"{mmproj} is missing: run `make` with --llama-cpp-src (or $GEM4_LLAMA_CPP) set, which writes it")
    dtype = getattr(torch, a.dtype)
    ckpt = open_checkpoint(a.text, mmproj)                    # both engines read llama.cpp's file
    model = bind_audio(ckpt, dtype, "cpu", choose(dtype, "cpu"))    # the backend gem4.load chooses
    ckpt.close()

    def encode():                                             # what the engine's runner calls for a clip
        with torch.no_grad():
            return encode_audio(model, clip).embeddings

    tokens = encode().shape[0]                                    # warm-up
    runs = {"gem4": [], "llama.cpp": []}
    for r in range(a.repeats):
        t0 = time.perf_counter()
        encode()
        runs["gem4"].append(time.perf_counter() - t0)
        if not a.no_llama:
            runs["llama.cpp"].append(mtmd_run(a, mmproj, path, []))
        print(f"repeat {r}: gem4 {runs['gem4'][-1]:.3f} s"
              + (f", llama.cpp {runs['llama.cpp'][-1]:.3f} s" if not a.no_llama else ""), flush=True)
    (OUT / "multimodal-audio.json").write_text(json.dumps({"args": saved_args(a), "tokens": tokens,
                                                            "runs": runs}, indent=1))
    g, ll = runs["gem4"], runs["llama.cpp"]
    print(f"\naudio encode, {a.seconds:g} s clip ({tokens} soft tokens), gem4 {a.dtype} (log-mel + conformer + "
          f"projection) / mmproj {a.type}, {a.threads} threads, medians of {a.repeats} (min-max), seconds\n")
    print("| clip | gem4 | llama.cpp | gem4 / llama.cpp |")
    print("|---|---|---|---|")
    ratio = f"{statistics.median(g) / statistics.median(ll):.2f}" if ll else "-"
    print(f"| {a.seconds:g} s | {summary(g)} | {summary(ll) if ll else '-'} | {ratio} |")


# ---- ttft ----

def chat(url: str, content, max_tokens: int = 1) -> dict:
    import httpx
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0}
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=1800)
    wall = time.perf_counter() - t0
    if r.status_code != 200:
        raise RuntimeError(f"{r.status_code}: {r.text[:500]}")
    usage = r.json()["usage"]
    details = usage.get("prompt_tokens_details") or {}
    return {"ttft_s": wall, "prompt_tokens": usage["prompt_tokens"], "cached_tokens": details.get("cached_tokens")}


def image_part(seed: int) -> dict:
    buf = io.BytesIO()
    picture(seed).save(buf, format="PNG")
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(buf.getvalue())
                                               .decode()}}


def cmd_ttft(a: argparse.Namespace) -> None:
    import signal

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from prefix import words
    from serve import free_port, vm_hwm_kb, wait_ready

    tok = gem4.Tokenizer.from_file(a.text)
    mmproj = OUT / f"mmproj-e2b-{a.type}.gguf"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "gem4.cli", "serve", str(a.text), "--mmproj", str(mmproj), "--port", str(port),
           "--max-num-seqs", "1", "--max-model-len", "4096", "--threads", str(a.threads), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(OUT / "multimodal-server.log", "ab"),
                            start_new_session=True)
    q1, q2 = "What is in this picture? Answer in one sentence.", "Which colours does it have most of?"
    rows = []
    try:
        wait_ready(proc, url, a.ready_timeout)
        warm = chat(url, [image_part(1000), {"type": "text", "text": q1}])            # warm-up: sizes its graphs
        probe = words(random.Random(1000), tok, 200)
        overhead = chat(url, probe)["prompt_tokens"] - len(tok.encode(probe, add_bos=False))   # the chat template's
        n_words = warm["prompt_tokens"] - overhead            # a text turn as long as the image turn
        for r in range(a.repeats):
            text = chat(url, words(random.Random(r), tok, n_words))
            img = image_part(r)
            first = chat(url, [img, {"type": "text", "text": q1}])
            second = chat(url, [img, {"type": "text", "text": q2}])
            rows.append({"repeat": r, "text": text, "image": first, "second": second})
            print(f"repeat {r}: text {text['prompt_tokens']} tokens {text['ttft_s']:.3f} s; image "
                  f"{first['prompt_tokens']} tokens {first['ttft_s']:.3f} s (cached {first['cached_tokens']}); "
                  f"second question {second['prompt_tokens']} tokens {second['ttft_s']:.3f} s "
                  f"(cached {second['cached_tokens']})", flush=True)
        rss = vm_hwm_kb(proc.pid) * 1024 / 1e9
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    (OUT / "multimodal-ttft.json").write_text(json.dumps({"args": saved_args(a), "rows": rows,
                                                           "rss_gb": rss}, indent=1))
    med = {k: statistics.median(row[k]["ttft_s"] for row in rows) for k in ("text", "image", "second")}
    print(f"\ngem4 serve, E2B-shaped Q4_0 text + E2B-shaped tower (mmproj {a.type}), {a.threads} threads, one "
          f"request at a time, medians of {a.repeats} (min-max); peak RSS {rss:.2f} GB\n")
    print("| turn | prompt tokens | cached | TTFT s | ratio | target |")
    print("|---|---|---|---|---|---|")
    for k, what, base, target in (("text", "text only, as long as the image turn", None, ""),
                                  ("image", "one 280-budget image + question", "text", "<= 1.2"),
                                  ("second", "second question, same image", "image", "<= 0.2")):
        xs = [row[k]["ttft_s"] for row in rows]
        ratio = f"{med[k] / med[base]:.2f} of {base}" if base else ""
        print(f"| {what} | {rows[0][k]['prompt_tokens']} | {rows[0][k]['cached_tokens']} | {summary(xs)} | "
              f"{ratio} | {target} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--type", default="f16", choices=("f32", "f16", "bf16", "q8_0"), help="the mmproj's type")
    common.add_argument("--threads", type=int, default=2)
    common.add_argument("--repeats", type=int, default=3)
    common.add_argument("--text", type=Path, default=TEXT, help="the E2B-shaped text GGUF (benchmarks/make_e2b.py)")
    common.add_argument("--llama-bin", default=os.environ.get("GEM4_LLAMA_BIN"),
                        help="the directory with llama-mtmd-cli (default $GEM4_LLAMA_BIN)")
    common.add_argument("--no-llama", action="store_true", help="gem4 alone")
    common.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="gem4's tower dtype")
    m = sub.add_parser("make", parents=[common])
    m.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    m.add_argument("--llama-cpp-src", default=os.environ.get("GEM4_LLAMA_CPP"),
                   help="llama.cpp's source (convert_hf_to_gguf.py, gguf-py) for the audio mmproj")
    m.set_defaults(func=cmd_make)
    e = sub.add_parser("encode", parents=[common])
    e.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    e.add_argument("--budgets", type=int, nargs="+", default=list(BUDGETS))
    e.set_defaults(func=cmd_encode)
    au = sub.add_parser("audio", parents=[common])
    au.add_argument("--seconds", type=float, default=10.0)
    au.set_defaults(func=cmd_audio)
    t = sub.add_parser("ttft", parents=[common])
    t.add_argument("--ready-timeout", type=float, default=600)
    t.set_defaults(func=cmd_ttft)
    a = p.parse_args()
    a.func(a)


if __name__ == "__main__":
    main()
