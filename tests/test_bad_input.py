"""Bad input, command by command: a non-zero exit, one line on stderr naming the problem, never a
traceback, and nothing run or downloaded first."""
import json
import sys

import gguf
import numpy as np
import pytest
import torch
from click.testing import CliRunner

from fastspec.cli.main import cli
from fastspec.model.llama import LlamaModel
from fastspec.model.loader import tiny_random_config, write_hf_checkpoint

TINY = ["--model", "tiny-random", "--backend", "eager"]
CHAT = ["chat", *TINY, "--prompt", "hi", "--max-new-tokens", "4"]
BENCH = ["bench", *TINY, "--prompts", "{ok_prompts}", "--max-new-tokens", "4"]
SPEED = ["speed", "--model", "tiny-random", "--no-hf", "--batch", "1", "--new-tokens", "2",
         "--tokens-per-forward", "1,2"]
PROFILE = ["profile", *TINY, "--batch", "1", "--block", "1", "--reps", "1", "--bandwidth-mib", "8",
           "--out", "{tmp}/p.json"]
TRAIN = ["train-drafter", "--model", "tiny-random", "--out", "{tmp}/draft", "--max-steps", "1",
         "--max-prompts", "2", "--target-tokens", "4"]

# (case id, argv, what the one line must say). {tmp}, {ok_prompts}, ... are files made below.
CASES = [
    # chat
    ("chat-temperature-nan", [*CHAT, "--temperature", "nan"], "--temperature must be a finite number >= 0, got nan"),
    ("chat-temperature-neg", [*CHAT, "--temperature", "-1"], "--temperature must be a finite number >= 0, got -1.0"),
    ("chat-top-p-0", [*CHAT, "--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
    ("chat-top-p-1.5", [*CHAT, "--top-p", "1.5"], "--top-p must be in (0, 1], got 1.5"),
    ("chat-top-k-neg", [*CHAT, "--top-k", "-1"], "--top-k must be >= 0, got -1"),
    ("chat-max-new-0", [*CHAT, "--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    ("chat-unknown-method", [*CHAT, "--method", "magic"], "unknown method 'magic'"),
    ("chat-ar-bad-block", [*CHAT, "--block", "7"], "--block must be one of (4, 8, 16, 32), got 7"),
    ("chat-bad-device", [*CHAT, "--device", "tpu"], "--device takes auto, cpu, cuda or cuda:N, got 'tpu'"),
    ("chat-relative-missing", ["chat", "--model", "checkpoints/llama", "--prompt", "hi"],
     "no such file or directory: checkpoints/llama"),
    ("chat-bin-only", ["chat", "--model", "{bin_only}", "--prompt", "hi"], "safetensors/GGUF only"),
    ("chat-truncated-safetensors", ["chat", "--model", "{truncated}", "--prompt", "hi"],
     "corrupt or truncated safetensors"),
    ("chat-gguf-arch", ["chat", "--model", "{gpt2_gguf}", "--prompt", "hi"],
     "unsupported GGUF architecture 'gpt2'"),
    ("chat-bad-dtype", [*CHAT, "--dtype", "int3"], "Invalid value for '--dtype'"),
    # bench
    ("bench-non-utf8-prompts", [*BENCH[:-4], "--prompts", "{latin1}"], "not UTF-8 text"),
    ("bench-malformed-prompts", [*BENCH[:-4], "--prompts", "{bad_json}"], "bad.jsonl:2: not valid JSON"),
    ("bench-no-prompt-field", [*BENCH[:-4], "--prompts", "{no_field}"], "no 'prompt' or 'question' field"),
    ("bench-malformed-data-dir", ["bench", *TINY, "--data-dir", "{data_dir}", "--bench", "gsm8k"],
     "gsm8k.jsonl:2: not valid JSON"),
    ("bench-data-row-lacks-field", ["bench", *TINY, "--data-dir", "{data_dir2}", "--bench", "gsm8k"],
     "gsm8k: row 1 of"),
    ("bench-unknown-suite", ["bench", *TINY, "--suite", "nope"], "unknown suite 'nope'"),
    ("bench-unknown-bench", ["bench", *TINY, "--bench", "gsm9k"], "unknown benchmark 'gsm9k'"),
    ("bench-unknown-method", [*BENCH, "--method", "magic"], "unknown method 'magic'"),
    ("bench-unknown-method-option", [*BENCH, "--method", "recguide[foo=1]"],
     "method 'recguide' has no option 'foo' (options: block, threshold,"),
    ("bench-unknown-peer", [*BENCH, "--peers", "hf,vllm"], "unknown peer 'vllm'"),
    ("speed-peer-not-llamacpp", [*SPEED, "--peers", "hf"], "speed runs one peer, llama.cpp (got hf)"),
    ("bench-ar-only-bad-block", [*BENCH, "--method", "ar", "--block", "7"],
     "--block must be one of (4, 8, 16, 32), got 7"),
    ("bench-linear-bad-block", [*BENCH, "--method", "ar,linear", "--block", "8,5"],
     "--block must be one of (4, 8, 16, 32), got 5"),
    ("bench-temperature-nan", [*BENCH, "--temperature", "nan"], "--temperature must be a finite number"),
    ("bench-top-p-1.5", [*BENCH, "--top-p", "1.5"], "--top-p must be in (0, 1]"),
    ("bench-top-k-neg", [*BENCH, "--top-k", "-1"], "--top-k must be >= 0"),
    ("bench-concurrency-0", [*BENCH, "--concurrency", "0"], "--concurrency takes positive integers, got '0'"),
    ("bench-max-new-0", [*BENCH[:-2], "--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    ("bench-limit-0", [*BENCH, "--limit", "0"], "--limit must be >= 1, got 0"),
    ("bench-unknown-backend", [*BENCH, "--backend", "eager,warp"], "unknown --backend warp"),
    ("bench-missing-prompts", [*BENCH[:-4], "--prompts", "{tmp}/none.jsonl"], "prompts file not found"),
    ("bench-linear-no-adapter", [*BENCH, "--method", "linear"], "needs a draft adapter"),
    ("bench-dflash-dir-missing", [*BENCH, "--method", "dflash", "--dflash", "{tmp}/nodflash"],
     "nodflash: no config.json there"),
    ("bench-bastion-no-dflash", [*BENCH, "--method", "bastion[drafter=dflash]"],
     "method 'bastion[drafter=dflash]' needs a DFlash drafter and tiny-random has none"),
    ("bench-dflash-no-drafter", [*BENCH, "--method", "dflash"], "needs a DFlash drafter"),
    ("bench-bad-drafter", [*BENCH, "--method", "libraspec[drafter=eagle]"], "drafter must be one of self, dflash"),
    ("bench-plot-no-matplotlib", ["bench", "--plot", "{results}"], "--plot needs matplotlib"),
    ("bench-json-unwritable", [*BENCH, "--json", "{ok_prompts}/r.json"], "r.json"),
    # speed
    ("speed-context-past-rope", [*SPEED, "--context", "100000"], "--context 100000 plus 2 new tokens exceeds"),
    ("speed-new-tokens-0", [*SPEED, "--new-tokens", "0"], "--new-tokens must be >= 1, got 0"),
    ("speed-repeats-0", [*SPEED, "--repeats", "0"], "Invalid value for '--repeats': 0 is not in the range x>=1"),
    ("speed-batch-0", [*SPEED, "--batch", "0"], "--batch takes positive integers"),
    ("speed-bad-device", [*SPEED, "--device", "gpu"], "--device takes auto, cpu, cuda or cuda:N"),
    # profile
    ("profile-context-past-rope", [*PROFILE, "--context", "100000"], "--context 100000 plus 1 new tokens exceeds"),
    ("profile-layout", [*PROFILE, "--layout", "tree"], "--layout takes chain and/or draft"),
    ("profile-reps-0", [*PROFILE, "--reps", "0"], "--reps must be >= 1, got 0"),
    ("profile-relative-missing", [*PROFILE[:1], "--model", "models/nope", *PROFILE[5:]],
     "no such file or directory: models/nope"),
    ("profile-unknown-backend", [*PROFILE, "--backend", "inductor"], "Invalid value for '--backend'"),
    # train-drafter
    ("train-device-tpu", [*TRAIN, "--device", "tpu"], "--device takes auto, cpu, cuda or cuda:N, got 'tpu'"),
    ("train-target-tokens", [*TRAIN, "--target-tokens", "1"], "--target-tokens must be >= 2, got 1"),
    ("train-gen-concurrency", [*TRAIN, "--gen-concurrency", "0"], "--gen-concurrency must be >= 1, got 0"),
    ("train-missing-data", [*TRAIN, "--data", "{tmp}/none.jsonl"], "none.jsonl not found"),
    ("train-non-utf8-data", [*TRAIN, "--data", "{latin1}"], "an input file is not UTF-8 text (byte 0xe9"),
    ("train-max-prompts-0", [*TRAIN, "--max-prompts", "0"], "--max-prompts must be >= 1, got 0"),
    ("train-missing-model", [*TRAIN[:1], "--model", "./nope", *TRAIN[3:]], "no such file or directory: ./nope"),
]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    f = {"tmp": str(d)}
    (d / "ok.jsonl").write_text(json.dumps({"prompt": "hi"}) + "\n")
    f["ok_prompts"] = str(d / "ok.jsonl")
    (d / "latin1.jsonl").write_bytes(json.dumps({"prompt": "caf\u00e9"}).encode("latin-1").replace(
        b"\\u00e9", b"\xe9") + b"\n")
    f["latin1"] = str(d / "latin1.jsonl")
    (d / "bad.jsonl").write_text(json.dumps({"prompt": "a"}) + "\n{not json\n")
    f["bad_json"] = str(d / "bad.jsonl")
    (d / "nofield.jsonl").write_text(json.dumps({"text": "a"}) + "\n")
    f["no_field"] = str(d / "nofield.jsonl")
    for name, lines in (("data", ['{"question": "1+1?", "answer": "#### 2"}', "{oops"]),
                        ("data2", ['{"answer": "#### 2", "id": 3}'])):
        (d / name).mkdir()
        (d / name / "gsm8k.jsonl").write_text("\n".join(lines) + "\n")
    f["data_dir"], f["data_dir2"] = str(d / "data"), str(d / "data2")

    model = LlamaModel(tiny_random_config()).init_random(0)
    (d / "bin").mkdir()
    (d / "bin" / "pytorch_model.bin").write_bytes(b"a pickle we never read")
    f["bin_only"] = str(d / "bin")
    # A valid config and a truncated tensor file: the error must come from reading the tensors.
    trunc = write_hf_checkpoint(model, d / "trunc")
    data = (trunc / "model.safetensors").read_bytes()
    (trunc / "model.safetensors").write_bytes(data[: len(data) // 2])
    f["truncated"] = str(trunc)
    w = gguf.GGUFWriter(str(d / "gpt2.gguf"), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f["gpt2_gguf"] = str(d / "gpt2.gguf")
    res = {"runs": [{"method": "ar", "concurrency": 1, "tokens_per_s": 1.0}],
           "records": [{"bench": "x", "method": "ar", "concurrency": 1, "new_tokens": 3, "latency_s": 1.0}]}
    (d / "r.json").write_text(json.dumps(res))
    f["results"] = str(d / "r.json")
    return f


@pytest.mark.parametrize("case, argv, message", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line(case, argv, message, files, monkeypatch, tmp_path):
    import huggingface_hub

    def no_network(*a, **k):
        raise AssertionError("bad input must not reach the network")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_network)
    monkeypatch.setenv("FASTSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    if case == "bench-plot-no-matplotlib":
        monkeypatch.setitem(sys.modules, "matplotlib", None)       # import matplotlib fails
    argv = [a.format(**files) for a in argv]
    result = CliRunner().invoke(cli, argv)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code not in (0, None), result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and message in lines[0], lines[0]


def test_the_table_covers_every_command():
    assert len(CASES) >= 25
    assert {argv[0] for _, argv, _ in CASES} == {"chat", "bench", "speed", "profile", "train-drafter"}


def test_bad_device_fails_before_the_model_loads(monkeypatch):
    """--device is checked first: a wrong one costs no load (a big checkpoint takes minutes)."""
    from fastspec.model import loader

    def no_load(*a, **k):
        raise AssertionError("loaded the model before checking --device")
    monkeypatch.setattr(loader, "_load_base", no_load)
    result = CliRunner().invoke(cli, [*CHAT, "--device", "cuda:7" if torch.cuda.is_available() else "cuda"])
    assert result.exit_code == 1 and "error: --device cuda" in result.stderr


def test_a_prompt_past_the_context_is_one_line_even_past_the_tokenizers_limit(monkeypatch):
    """A real tokenizer knows the model's context (model_max_length) and transformers warns when a
    text encodes longer than that; the run's own error line must stay the only line."""
    import fastspec.model.byte_tokenizer as bt
    make = bt.byte_tokenizer

    def limited():
        tok = make()
        tok.model_max_length = 512                  # tiny-random's context, as a GGUF's tokenizer has
        return tok
    monkeypatch.setattr(bt, "byte_tokenizer", limited)
    result = CliRunner().invoke(cli, [*CHAT[:-4], "--prompt", "x" * 600, "--max-new-tokens", "4"])
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code not in (0, None), result.output
    assert len(lines) == 1 and "but the context is 512" in lines[0], result.stderr
