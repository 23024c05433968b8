"""CLI: bad input gives one clear line and a non-zero exit, never a traceback."""
import io
import json
import os

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
    """A complete config and a tensor file of garbage: the error comes from reading the tensors."""
    from fastspec.model.llama import LlamaModel
    from fastspec.model.loader import tiny_random_config, write_hf_checkpoint
    d = write_hf_checkpoint(LlamaModel(tiny_random_config()).init_random(0), tmp_path / "m")
    (d / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage" + b"\x00" * 64)
    result, text = run("chat", "--model", str(d), "--prompt", "hi")
    assert_one_line_error(result, text, "corrupt or truncated safetensors")


def test_unsupported_architecture_is_one_clear_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    result, text = run("chat", "--model", str(tmp_path), "--prompt", "hi")
    assert_one_line_error(result, text, "unsupported architecture")


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    """A draft adapter for tiny-random whose LoRA is not the identity (drafts really differ)."""
    import torch
    from fastspec.draft import AdapterConfig, attach_adapter, save_adapter
    from fastspec.model.loader import load_model
    model = load_model("tiny-random", adapter=None).model
    attach_adapter(model, AdapterConfig(rank=4))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for blk in model.layers:
            for lora in blk.attn.lora.values():
                lora.B.copy_(0.1 * torch.randn(lora.B.shape, generator=g))
    d = tmp_path_factory.mktemp("adapter")
    save_adapter(model, str(d))
    return str(d)


def write_prompts(path, texts):
    path.write_text("\n".join(json.dumps({"prompt": t}) for t in texts))
    return str(path)


def bench_json(tmp_path, adapter, *args):
    out = tmp_path / "r.json"
    result, text = run("bench", "--model", "tiny-random", "--adapter", adapter, "--backend", "eager",
                       "--max-new-tokens", "8", "--json", str(out), *args)
    return result, text, (json.loads(out.read_text()) if out.exists() else None)


def test_bench_on_own_prompts_writes_json(tmp_path, adapter_dir):
    prompts = write_prompts(tmp_path / "p.jsonl", [f"question {i}" for i in range(3)])
    result, text, data = bench_json(tmp_path, adapter_dir, "--prompts", prompts, "--method", "ar,linear",
                                    "--block", "4", "--concurrency", "1,3")
    assert result.exit_code == 0, text
    assert "tiny-random on cpu" in text and "float32, backend eager" in text      # the header
    assert {(r["method"], r["concurrency"], r["batch_bucket"]) for r in data["runs"]} == {
        (m, c, b) for m in ("ar", "linear") for c, b in ((1, 1), (3, 4))}
    assert len(data["records"]) == 12
    assert {(r["concurrency"], r["batch_bucket"]) for r in data["records"]} == {(1, 1), (3, 4)}
    linear = [r for r in data["records"] if r["method"] == "linear"]
    # LinearSS against AR, token for token (greedy), with real drafting (≥ 2 tokens per round).
    assert all(r["identical"] is True for r in linear)
    assert lookup_tau(data, "linear") > 1.5 and lookup_tau(data, "ar") == 1.0
    env = data["environment"]
    assert env["device"].startswith("cpu") and env["dtype"] == "float32" and env["backend"] == "eager"
    assert env["torch"] and env["adapter"] == adapter_dir


def lookup_tau(data, method):
    return next(r["tau"] for r in data["metrics"]["by_method"] if r["method"] == method)


def test_identical_can_be_false(tmp_path, adapter_dir):
    """Sampled LinearSS follows AR's law, not AR's tokens: the check must say so."""
    prompts = write_prompts(tmp_path / "p.jsonl", [f"question {i}" for i in range(3)])
    result, text, data = bench_json(tmp_path, adapter_dir, "--prompts", prompts, "--method", "ar,linear",
                                    "--block", "4", "--temperature", "1")
    assert result.exit_code == 0, text
    same = [r["identical"] for r in data["records"] if r["method"] == "linear"]
    assert False in same


def test_a_request_that_cannot_run_is_an_error_row(tmp_path, adapter_dir):
    # tiny-random has 512 positions and one token per byte: the second prompt cannot fit.
    prompts = write_prompts(tmp_path / "p.jsonl", ["short one", "x" * 600, "short two"])
    result, text, data = bench_json(tmp_path, adapter_dir, "--prompts", prompts, "--method", "ar,linear",
                                    "--block", "4", "--concurrency", "2")
    assert result.exit_code == 0, text
    assert "could not run (2: prompts/1 ar C=2, prompts/1 linear C=2): prompt of 619 tokens plus 8 " \
           "new tokens needs 627 positions but the context is 512" in text
    errors = [r for r in data["records"] if r["error"]]
    assert [(r["method"], r["problem_id"], r["finish_reason"]) for r in errors] == [
        ("ar", "1", "error"), ("linear", "1", "error")]
    ok = [r for r in data["records"] if not r["error"]]
    assert len(ok) == 4 and all(r["new_tokens"] > 0 for r in ok)
    assert all(r["errors"] == 1 for r in data["runs"])
    assert all(r["errors"] == 1 and r["requests"] == 2 for r in data["metrics"]["by_method"])


def test_ctrl_c_in_bench_keeps_every_finished_run(tmp_path, adapter_dir, monkeypatch):
    from fastspec.evals import runner
    real, calls = runner._run_one, []

    def interrupt_second(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)
    monkeypatch.setattr(runner, "_run_one", interrupt_second)
    prompts = write_prompts(tmp_path / "p.jsonl", ["a", "b"])
    result, text, data = bench_json(tmp_path, adapter_dir, "--prompts", prompts, "--concurrency", "1,2")
    assert result.exit_code == 130 and "every finished" in text
    assert [(r["method"], r["concurrency"]) for r in data["runs"]] == [("ar", 1)]
    assert len(data["records"]) == 2
    assert not list(tmp_path.glob("r.json.tmp*"))          # written atomically: no temp file left


def test_chat_reports_a_failed_turn_and_goes_on():
    result = CliRunner().invoke(cli, ["chat", "--model", "tiny-random", "--backend", "eager",
                                      "--max-new-tokens", "3"], input="x" * 600 + "\nhi\n\n")
    assert result.exit_code == 0, result.output
    assert result.stderr.count("error: prompt plus --max-new-tokens needs") == 1
    assert result.stderr.count("tok/s") == 1              # the second turn was answered


def test_ctrl_c_in_chat_cancels_the_answer_not_the_conversation(monkeypatch):
    from fastspec.engine import Engine
    real, calls = Engine.generate, []

    def cancel_first(self, prompts, *a, **k):
        calls.append(prompts[0])
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real(self, prompts, *a, **k)
    monkeypatch.setattr(Engine, "generate", cancel_first)
    result = CliRunner().invoke(cli, ["chat", "--model", "tiny-random", "--backend", "eager",
                                      "--max-new-tokens", "3"], input="first\nsecond\n\n")
    assert result.exit_code == 0, result.output
    assert "(answer cancelled)" in result.stderr and result.stderr.count("tok/s") == 1
    assert "first" not in calls[1] and "second" in calls[1]     # the cancelled turn left no trace


def test_speed_records_where_it_ran(tmp_path):
    out = tmp_path / "s.json"
    result, text = run("speed", "--model", "tiny-random", "--backend", "eager", "--no-hf", "--batch", "1",
                       "--new-tokens", "3", "--tokens-per-forward", "1,2", "--context", "8",
                       "--bandwidth-mib", "8", "--json", str(out))
    assert result.exit_code == 0, text
    assert "on cpu" in text and "float32, backend eager" in text
    data = json.loads(out.read_text())
    assert data["environment"]["backend"] == "eager" and data["environment"]["dtype"] == "float32"
    assert {(r["batch"], r["block"], r["layout"]) for r in data["forward"]} == {
        (b, n, lay) for b in (1, 4) for n in (1, 2) for lay in ("chain", "draft")}


def test_speed_and_llama_cpp_take_turns_and_the_ratio_is_the_median_of_the_pairs(tmp_path, monkeypatch):
    """`--repeats 3 --peers llama.cpp`: after both warm up, fastspec and llama.cpp alternate three
    times; the row gives each side's median and the median of the three paired ratios, overall
    and for decoding alone (the prefill left out)."""
    import statistics

    import fastspec.evals.peers as peers
    from fastspec.engine import Engine
    order = []
    real_generate = Engine.generate

    def generate(self, prompts, params, **kw):
        order.append(("fastspec", params.max_new_tokens))
        return real_generate(self, prompts, params, **kw)

    def llama_generate(llm, ids, max_new_tokens, stop):
        order.append(("llama.cpp", max_new_tokens))
        return [1] * max_new_tokens, 0.0
    monkeypatch.setattr(Engine, "generate", generate)
    monkeypatch.setattr(peers, "check_peers", lambda names: None)
    monkeypatch.setattr(peers, "llamacpp_model", lambda loaded, directory: object())
    monkeypatch.setattr(peers, "llamacpp_generate", llama_generate)
    out = tmp_path / "s.json"
    result, text = run("speed", "--model", "tiny-random", "--backend", "eager", "--no-hf", "--batch", "1",
                       "--new-tokens", "3", "--tokens-per-forward", "1", "--context", "8", "--repeats", "3",
                       "--peers", "llama.cpp", "--bandwidth-mib", "8", "--json", str(out))
    assert result.exit_code == 0, text
    assert "medians of 3 runs, in turns with llama.cpp" in text
    assert order == [("fastspec", 4), ("llama.cpp", 4)] + [("fastspec", 3), ("llama.cpp", 3)] * 3
    row, = json.loads(out.read_text())["generate"]
    ours, theirs = row["tokens_per_s_runs"], row["llamacpp_tokens_per_s_runs"]
    assert row["runs"] == 3 and len(ours) == len(theirs) == 3
    assert row["tokens_per_s"] == statistics.median(ours)
    assert row["llamacpp_tokens_per_s"] == statistics.median(theirs)
    assert row["vs_llamacpp"] == pytest.approx(statistics.median(a / b for a, b in zip(ours, theirs)))
    # decode only: the steps after the prefill, both sides (3 tokens: 2 after the first)
    assert row["decode_tokens_per_s"] == pytest.approx(1e3 / row["step_ms"])
    assert row["llamacpp_decode_tokens_per_s"] > 0 and row["vs_llamacpp_decode"] > 0
    assert "decode only" in text


def test_speed_times_the_shapes_in_turns_after_compiling_them_all(monkeypatch):
    """T(N) rows: every shape is built first, then the shapes take turns, so no shape is timed
    right after its own compilation; ms is the median of all its calls."""
    import fastspec.graphs.profile as profile
    from evals.speed import forward_times
    from fastspec.model.loader import load_model
    order, first_calls = [], []
    real = profile.measure_point

    def measure(fwd, model, batch, block, layout, ctx, reps):
        first_calls.append((block, layout, reps))
        seen = len(order)
        point = real(fwd, model, batch, block, layout, ctx, reps)
        del order[seen:]                                   # its own warm-up timing, not a turn
        return point

    def samples(fwd, inputs, device, reps):
        order.append(inputs[0].shape[1])
        return [float(inputs[0].shape[1])] * reps
    monkeypatch.setattr(profile, "measure_point", measure)
    monkeypatch.setattr(profile, "forward_samples", samples)
    times = forward_times(load_model("tiny-random"), 1, [1, 2], 8, "eager", reps=4, passes=3)
    assert first_calls == [(1, "chain", 1), (1, "draft", 1), (2, "chain", 1), (2, "draft", 1)]
    assert order == [1, 1, 2, 2] * 3                       # three rounds, every shape in each
    assert {key: (t["ms"], t["samples"]) for key, t in times.items()} == {
        (n, lay): (float(n), 12) for n in (1, 2) for lay in ("chain", "draft")}


def test_bench_on_int8_weights_is_lossless_against_ar_on_the_same_weights(tmp_path, adapter_dir):
    prompts = write_prompts(tmp_path / "p.jsonl", [f"question {i}" for i in range(2)])
    result, text, data = bench_json(tmp_path, adapter_dir, "--prompts", prompts, "--method", "ar,linear",
                                    "--block", "4", "--weights", "int8")
    assert result.exit_code == 0, text
    assert "weights int8" in text and "kernel" in text                     # the header says what ran
    env = data["environment"]
    assert env["weights"] == "int8" and env["kernel"] and env["isa"]
    assert all(r["identical"] is True for r in data["records"] if r["method"] == "linear")


def test_speed_header_names_weights_and_kernel(tmp_path):
    out = tmp_path / "s.json"
    result, text = run("speed", "--model", "tiny-random", "--backend", "eager", "--no-hf", "--batch", "1",
                       "--new-tokens", "3", "--tokens-per-forward", "1", "--context", "8",
                       "--bandwidth-mib", "8", "--weights", "bf16", "--json", str(out))
    assert result.exit_code == 0, text
    assert "weights bf16" in text
    assert json.loads(out.read_text())["environment"]["weights"] == "bf16"


def test_recguide_flags_fold_into_the_method_spec_and_a_tables_path_keeps_its_slashes(tmp_path):
    """`--adaptive-blocks 8,16,32` with survival tables at a path: the path stays one string
    (it once split on '/' like a block list and crashed)."""
    from fastspec.cli.main import with_recguide_options
    from fastspec.methods import get_method, parse_method_spec
    tables = tmp_path / "sub" / "tables.json"
    tables.parent.mkdir()
    tables.write_text("{}")
    spec = with_recguide_options("linear,recguide[stratum=0]", "tiny-random", adaptive_blocks="8,16,32",
                                 tables=str(tables), no_bucketing=True)
    linear, recguide = spec.split(",", 1)
    assert linear == "linear"
    name, opts = parse_method_spec(recguide)
    assert name == "recguide" and opts["blocks"] == (8, 16, 32) and opts["tables"] == str(tables)
    assert opts["use_stratum"] == 0 and opts["bucketing"] == 0
    assert parse_method_spec("bastion[blocks=8/16]")[1] == {"blocks": (8, 16)}
    with pytest.raises(Exception, match="tables"):
        get_method(recguide)          # an empty JSON is not a survival table: a clear error


def test_the_default_survival_tables_enter_the_method_label_relative_to_the_working_dir(monkeypatch):
    """The folded spec is the run's method label (tables, JSON): the shipped tables read as
    profiles/..., not as an absolute path."""
    from fastspec.cli.calibrate import default_tables_path
    from fastspec.cli.main import with_recguide_options
    root = os.path.dirname(os.path.dirname(os.path.abspath(default_tables_path("smollm2-135m"))))
    monkeypatch.chdir(root)
    spec = with_recguide_options("recguide", "smollm2-135m", adaptive_blocks="4,8")
    assert spec == "recguide[blocks=4/8;tables=profiles/smollm2-135m-survival.json]"


def test_branch_slot_and_correction_seed_flags_build_a_mixed_recguide():
    from fastspec.cli.main import with_recguide_options
    from fastspec.methods import get_method
    spec = with_recguide_options("recguide", "tiny-random", branch_policy="likelihood",
                                 branch_slots=5, correction_seed="mix")
    m = get_method(spec)
    assert (m.policy, m.n_cand, m.seed) == ("likelihood", 5, "mix")
    assert "mixed" in m.key_name() and "slots=5" in m.key_name()


def test_bench_runs_the_dflash_drafted_methods_from_a_dflash_folder(tmp_path, adapter_dir):
    """--dflash DIR loads a drafter in the public format; dflash and bastion[drafter=dflash] run
    on it next to LinearSS, every request identical to AR, and the run header names it."""
    from fastspec.model.dflash import DFlashDrafter, drafter_config_for, save_dflash
    from fastspec.model.loader import load_model
    target = load_model("tiny-random", adapter=None, dflash=None).model
    cfg = drafter_config_for(target.cfg, 1, (0, 1), 8, 7)
    drafter = DFlashDrafter(cfg, max_positions=target.rope_cos.shape[0]).init_random(3)
    save_dflash(drafter, tmp_path / "dflash")
    prompts = write_prompts(tmp_path / "p.jsonl", [f"question {i}" for i in range(2)])
    result, text, data = bench_json(tmp_path, adapter_dir, "--prompts", prompts, "--dflash",
                                    str(tmp_path / "dflash"),
                                    "--method", "ar,linear,dflash,bastion[drafter=dflash]")
    assert result.exit_code == 0, text
    assert {r["method"] for r in data["records"]} == {"ar", "linear", "dflash", "bastion[drafter=dflash]"}
    assert all(r["identical"] is True for r in data["records"])
    assert data["environment"]["dflash"] == str(tmp_path / "dflash")


def test_bench_gives_tidar_its_own_block_unless_a_block_is_asked_for():
    """No --block: the suite's B = 8, except TiDAR (B + B² tokens a forward), which chooses its
    own from the device's profile (auto); an explicit --block applies to every method; a block
    in the spec's brackets wins."""
    from fastspec.evals.runner import parse_methods
    assert parse_methods("linear,tidar,bastion", None, True) == [
        ("ar", "ar", None), ("linear", "linear", 8), ("tidar", "tidar", "auto"), ("bastion", "bastion", 8)]
    assert parse_methods("linear,tidar", [16], False) == [("linear", "linear", 16), ("tidar", "tidar", 16)]
    assert parse_methods("tidar[block=2]", None, False) == [("tidar[block=2]", "tidar[block=2]", "auto")]
    from fastspec.evals.runner import default_block
    from fastspec.methods import get_method
    assert get_method("tidar[block=2]", block="auto").block == 2
    assert get_method("tidar", block="auto").auto and not get_method("tidar", block=4).auto
    assert (default_block("tidar[seed=guess]"), default_block("linear"), default_block("ar")) == ("auto", 8, 8)


def test_interleaved_bench_changes_the_clock_not_the_tokens(tmp_path, adapter_dir):
    """--interleave: the methods take turns on groups of prompts (paired timing on a drifting
    machine). Every request decodes to the same tokens in the same rounds as in the plain run,
    the runs' counts and the methods' reports add up over the parts, and the calibration block
    numbers its requests across parts. (4 prompts: at C=2 every group is full; a short last group
    would run as a smaller C, with that C's cost model.)"""
    prompts = write_prompts(tmp_path / "p.jsonl", [f"question {i}" for i in range(4)])
    # LibraSpec priced by the profile: with measured step times its AR-round choice follows the
    # clock, which interleaving changes.
    args = ("--prompts", prompts, "--method", "ar,linear,libraspec[prices=profile],tidar", "--block", "4",
            "--concurrency", "1,2")
    plain_dir, inter_dir = tmp_path / "plain", tmp_path / "inter"
    plain_dir.mkdir(), inter_dir.mkdir()
    r1, t1, plain = bench_json(plain_dir, adapter_dir, *args)
    r2, t2, inter = bench_json(inter_dir, adapter_dir, *args, "--interleave", "1")
    assert r1.exit_code == 0 and r2.exit_code == 0, t1 + t2
    assert "interleaved" in t2 and plain["environment"]["interleave"] == 0
    assert "paired per request vs AR, C=1: linear" in t2 and "paired per request" not in t1
    assert all(r["paired_speedup"]["requests"] == 4 for r in inter["metrics"]["by_method"] if r["method"] != "ar")
    assert inter["environment"]["interleave"] == 1

    def by_request(data):
        return {(r["method"], r["concurrency"], r["problem_id"]): (r["completion"], r["rounds"], r["accept_lengths"])
                for r in data["records"]}
    assert by_request(inter) == by_request(plain) and len(by_request(plain)) == 4 * 2 * 4
    assert all(r["identical"] is True for r in inter["records"])

    def counts(data):
        return {(r["method"], r["concurrency"]): (r["requests"], r["new_tokens"], r["forwards"], r["rounds"],
                                                  r["request_forwards"], r["batch_bucket"])
                for r in data["runs"]}
    assert counts(inter) == counts(plain)
    reports = lambda data, m, keys: {r["concurrency"]: {k: r["method_report"][k] for k in keys}
                                     for r in data["runs"] if r["method"] == m}
    libra = "libraspec[prices=profile]"
    assert reports(inter, libra, ("rounds", "gamma_share")) == reports(plain, libra, ("rounds", "gamma_share"))
    assert reports(inter, "tidar", ("rounds", "seed_trials", "seed_hits")) == \
        reports(plain, "tidar", ("rounds", "seed_trials", "seed_hits"))
    cal = lambda data: {r["concurrency"]: (r["calibration"]["all"]["rounds"], r["calibration"]["all"]["positions"])
                        for r in data["runs"] if r["method"] == "linear"}
    assert cal(inter) == cal(plain)


def test_interleave_must_not_be_negative(tmp_path, adapter_dir):
    prompts = write_prompts(tmp_path / "p.jsonl", ["question"])
    result, text, _ = bench_json(tmp_path, adapter_dir, "--prompts", prompts, "--interleave", "-1")
    assert_one_line_error(result, text, "--interleave must be >= 0")


def test_a_concurrency_sweep_builds_each_step_once(tmp_path, adapter_dir):
    """One KV cache for the whole sweep: RecGuide's 2-row steps and the prefill, built while C=2
    ran, serve C=4 as they are. With a cache sized for each C they compiled again at C=4 (every
    step reads the per-slot state), on the real model inside C=4's timed rounds."""
    from rich.console import Console
    from fastspec.engine import Engine
    from fastspec.evals.runner import run_bench
    from fastspec.model.loader import load_model
    prompts = write_prompts(tmp_path / "p.jsonl", [f"question {i} " * (1 + i % 3) for i in range(6)])
    engines = []

    def load_engine(model, dtype, backend, **_):
        engines.append(Engine(load_model("tiny-random", adapter=adapter_dir), backend="compile",
                              compiler="aot_eager"))
        return engines[-1]

    out = tmp_path / "r.json"
    run_bench(model="tiny-random", dtype="float32", backend="compile", max_new_tokens=12, temperature=0.0,
              top_p=1.0, top_k=0, seed=0, suite=None, benches=None, prompts_file=prompts, limit=6,
              methods="recguide[blocks=4/8]", blocks=None, concurrency="2,4", data_dir=None,
              json_out=str(out), peers=None, baseline=False, console=Console(file=io.StringIO()),
              load_engine=load_engine, interleave=1)
    runs = json.loads(out.read_text())["runs"]
    assert [r["concurrency"] for r in runs] == [2, 4] and all(r["recompiles"] == 0 for r in runs)
    stats = engines[0].runner.stats()
    assert any(k.batch == 2 and k.block == 4 for k in stats)          # built at C=2, used at C=4
    assert {str(k): v["compiles"] for k, v in stats.items() if v["compiles"] != 1} == {}
