"""What every fastspec command shares: user errors become one line and a non-zero exit; the
--device / --dtype / --backend options."""
from __future__ import annotations

import functools
import sys

import click
from rich.console import Console
from rich.markup import escape

from fastspec.config import FastspecError

# Piped output (CI logs, files) gets wide tables instead of 80 columns of ellipses.
console = Console(stderr=False, width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else 160)


def report_error(e: BaseException) -> None:
    """`error: <message>` on stderr as one line: never wrapped, the message never read as markup."""
    err_console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)


def user_errors(fn=None, *, interrupted: str = "interrupted"):
    """Turn expected failures into one clear line and a non-zero exit, never a traceback."""
    if fn is None:
        return functools.partial(user_errors, interrupted=interrupted)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (FastspecError, OSError) as e:     # OSError: an unwritable --json path, a full disk
            report_error(e)
            sys.exit(1)
        except UnicodeDecodeError as e:        # a text input that is not UTF-8, wherever it is read
            report_error(FastspecError(f"an input file is not UTF-8 text (byte 0x{e.object[e.start]:02x} "
                                       f"at offset {e.start}: {e.reason})"))
            sys.exit(1)
        except KeyboardInterrupt:
            err_console.print(interrupted, highlight=False, markup=False)
            sys.exit(130)
    return wrapper


MODEL_HELP = ("Checkpoint: a built-in name (smollm2-135m, tiny-random), an HF directory "
              "(config.json + *.safetensors), a .gguf file or hf:owner/name (Hugging Face Hub).")


def device_options(fn):
    """--device and --dtype, shared by every command that loads a model."""
    fn = click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16"]), default="auto",
                      show_default=True, help="Weight and activation precision; auto: bfloat16 on a "
                                              "GPU, float32 on the CPU.")(fn)
    fn = click.option("--device", default="auto", show_default=True,
                      help="auto (the GPU when there is one) | cpu | cuda | cuda:N.")(fn)
    return fn


WEIGHTS_HELP = ("Precision of the big linear weights (attention, MLP, LM head), rounded in place after "
                "loading: fp32; bf16 (half the bytes a decode step reads); int8 (symmetric per-output-"
                "channel scales, a quarter). The CPU kernel widens them to fp32 in registers; "
                "activations, K/V and logits keep --dtype. Every method (and the transformers peers) "
                "runs on the same rounded weights, so self-speculation stays lossless against AR on them.")


def weights_option(fn):
    """--weights fp32|bf16|int8 (fastspec/weights.py), for the commands that decode or time steps."""
    return click.option("--weights", type=click.Choice(["fp32", "bf16", "int8"]), default="fp32",
                        show_default=True, help=WEIGHTS_HELP)(fn)


BACKEND_HELP = ("auto: CUDA graphs on a GPU, torch.compile on the CPU. cuda-graph: one captured graph "
                "per step shape. compile: one torch.compile'd static step per (batch, block, "
                "layout), fast after a warm-up. eager: plain PyTorch (no warm-up).")


def backend_option(fn):
    from fastspec.graphs.runner import BACKENDS
    return click.option("--backend", type=click.Choice(BACKENDS), default="auto", show_default=True,
                        help=BACKEND_HELP)(fn)


class OneLineErrors(click.Group):
    """Click's own usage errors (a flag of the wrong type, an unknown choice) as one line too:
    by default click prints the usage, a hint and the error over four lines."""

    def main(self, *args, standalone_mode: bool = True, **kwargs):
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            rv = super().main(*args, standalone_mode=False, **kwargs)
        except click.ClickException as e:
            if type(e).__name__ == "NoArgsIsHelpError":      # bare `fastspec`: the help, as usual
                e.show()
                sys.exit(e.exit_code)
            ctx = getattr(e, "ctx", None)
            hint = f" (see {ctx.command_path} --help)" if ctx is not None else ""
            report_error(FastspecError(e.format_message() + hint))
            sys.exit(e.exit_code)
        except click.Abort:                    # Ctrl-C / Ctrl-D inside a click prompt
            sys.exit(130)
        sys.exit(rv if isinstance(rv, int) else 0)     # Exit (e.g. --help) returns its code
