"""Training the draft adapter: self-distilled data (`data`), the block-diffusion trainer
(`trainer`) and the `train-drafter` command (`command`)."""
from fastspec.train.data import (GENERAL_PROMPTS, Example, build_targets, default_data_path,
                                 load_questions, target_cache_path, training_prompts)
from fastspec.train.trainer import (Batch, DraftTrainer, TrainConfig, draft_block_mask,
                                    draft_logits, draft_loss, make_batch, training_mask)

__all__ = ["GENERAL_PROMPTS", "Example", "build_targets", "default_data_path", "load_questions",
           "target_cache_path", "training_prompts", "Batch", "DraftTrainer", "TrainConfig",
           "draft_block_mask", "draft_logits", "draft_loss", "make_batch", "training_mask"]
