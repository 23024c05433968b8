"""Training the draft adapter: self-distilled data (`data`), the block-diffusion trainer
(`trainer`) and the `train-drafter` command (`fastspec.cli.train`)."""
from fastspec.train.data import (GENERAL_PROMPTS, Example, Source, build_targets, check_not_benchmark,
                                 default_data_path, load_questions, mixture_prompts, parse_mixture,
                                 target_cache_path, training_prompts)
from fastspec.train.trainer import (Batch, DraftTrainer, TrainConfig, draft_logits, draft_loss,
                                    make_batch, parse_block_mix, training_mask)

__all__ = ["GENERAL_PROMPTS", "Example", "Source", "build_targets", "check_not_benchmark",
           "default_data_path", "load_questions", "mixture_prompts", "parse_mixture",
           "target_cache_path", "training_prompts", "Batch", "DraftTrainer", "TrainConfig",
           "draft_logits", "draft_loss", "make_batch", "parse_block_mix", "training_mask"]
