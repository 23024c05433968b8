"""CLI: bad input gives one clear line and a non-zero exit, never a traceback."""
import json

import pytest
from click.testing import CliRunner

from fastspec.cli.main import cli


def run(*args, **kw):
    result = CliRunner().invoke(cli, list(args), **kw)
    return result, result.output or ""


def assert_one_line_error(result, text, needle):
    assert result.exit_code != 0, text
    assert "Traceback" not in text
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert needle.lower() in text.lower(), text


def test_help_explains_the_commands():
    result, text = run("--help")
    assert result.exit_code == 0
    for word in ("chat", "bench", "speed"):
        assert word in text


def test_chat_one_shot_on_tiny_model_streams_an_answer():
    result, text = run("chat", "--model", "tiny-random", "--backend", "eager", "--prompt", "hi",
                       "--max-new-tokens", "5")
    assert result.exit_code == 0, text
    assert "tok/s" in text


@pytest.mark.parametrize("args, needle", [
    (["bench", "--model", "tiny-random", "--backend", "eager,warp", "--prompts", "x.jsonl"], "backend"),
    (["chat", "--model", "tiny-random", "--adapter", "/nonexistent", "--prompt", "hi"], "adapter_config.json"),
    (["chat", "--model", "/nonexistent/ckpt", "--prompt", "hi"], "no such file"),
    (["chat", "--model", "tiny-random", "--prompt", "  "], "empty prompt"),
    (["chat", "--model", "tiny-random", "--backend", "eager", "--prompt", "hi", "--temperature", "-1"], "temperature"),
    (["chat", "--model", "tiny-random", "--backend", "eager", "--prompt", "hi", "--top-p", "0"], "top-p"),
    (["chat", "--model", "tiny-random", "--backend", "eager", "--prompt", "hi", "--max-new-tokens", "0"], "max-new-tokens"),
    (["chat", "--model", "tiny-random", "--backend", "eager", "--prompt", "hi", "--method", "magic"], "unknown method"),
    (["chat", "--model", "tiny-random", "--backend", "eager", "--prompt", "x" * 2000], "context"),
    (["chat", "--backend", "warp"], "warp"),
    (["bench", "--suite", "nope", "--model", "tiny-random"], "nope"),
    (["bench", "--model", "tiny-random", "--concurrency", "0"], "concurrency"),
    (["bench", "--model", "tiny-random", "--concurrency", "a,b"], "concurrency"),
    (["bench", "--model", "tiny-random", "--limit", "0"], "limit"),
])
def test_bad_input_is_one_clear_line(args, needle):
    result, text = run(*args)
    assert_one_line_error(result, text, needle)


def test_corrupt_checkpoint_is_one_clear_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (tmp_path / "model.safetensors").write_bytes(b"\x00garbage")
    result, text = run("chat", "--model", str(tmp_path), "--prompt", "hi")
    assert_one_line_error(result, text, "error")


def test_unsupported_architecture_is_one_clear_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    result, text = run("chat", "--model", str(tmp_path), "--prompt", "hi")
    assert_one_line_error(result, text, "unsupported architecture")


def test_bench_on_own_prompts_writes_json(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"question {i}"}) for i in range(3)))
    out = tmp_path / "r.json"
    result, text = run("bench", "--model", "tiny-random", "--backend", "eager", "--prompts", str(prompts),
                       "--max-new-tokens", "4", "--concurrency", "1,2", "--json", str(out))
    assert result.exit_code == 0, text
    data = json.loads(out.read_text())
    assert {r["concurrency"] for r in data["runs"]} == {1, 2}
    assert data["metrics"]["by_method"][0]["tau"] is not None
    assert len(data["records"]) == 6
    assert all(r["identical"] for r in data["records"])
    assert data["environment"]["torch"]
