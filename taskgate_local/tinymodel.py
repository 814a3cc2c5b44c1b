"""Builds a tiny random-weight Wan text-to-video pipeline offline, for tests and local runs."""

from __future__ import annotations

import argparse
import os
import shutil
import string
import sys
from pathlib import Path
from typing import Any

MODEL_NAME = "wan-tiny"

_WORDS_TEXT = (
    "a an the and of in on at with over under by to from is are this that cat dog bird fish horse monkey "
    "person man woman child robot car train boat plane runs walks jumps flies swims dances sits sleeps plays "
    "looks moves red blue green yellow white black orange purple bright dark sky sea ocean river forest city "
    "street room beach mountain snow rain sun moon day night morning evening light shadow fire water tree "
    "flower grass road video cinematic slow motion close up wide shot camera high quality blurry low"
)

# Same special-token layout as the real UMT5 tokenizer: pad=0, eos=1, unk=2.
_SPECIALS = ("<pad>", "</s>", "<unk>")


def tiny_vocab() -> list[tuple[str, float]]:
    """Unigram pieces and scores for the tiny tokenizer: whole words, then single characters as a fallback."""
    vocab: list[tuple[str, float]] = [(piece, 0.0) for piece in _SPECIALS]
    vocab += [("\u2581" + word, -2.0 - i * 0.01) for i, word in enumerate(_WORDS_TEXT.split())]
    vocab.append(("\u2581", -5.0))
    chars = string.ascii_lowercase + string.ascii_uppercase + string.digits + string.punctuation
    vocab += [(ch, -10.0 - i * 0.01) for i, ch in enumerate(chars)]
    return vocab


def build_tiny_pipeline(folder: Path, seed: int = 0) -> Path:
    """Build the tiny random-weight WanPipeline, save it into `folder` and return `folder`."""
    # Imported here so the CLI's "already built" path does not pay torch's import time.
    import torch
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    from transformers import T5Tokenizer, UMT5Config, UMT5EncoderModel
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()

    folder = Path(folder)
    tokenizer = T5Tokenizer(vocab=tiny_vocab(), extra_ids=0)

    torch.manual_seed(seed)
    text_encoder = UMT5EncoderModel(
        UMT5Config(
            vocab_size=len(tokenizer),
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=32,
            pad_token_id=0,
            eos_token_id=1,
            decoder_start_token_id=0,
        )
    ).eval()

    torch.manual_seed(seed)
    # Spatial /8 and temporal /4 like the real Wan VAE, so the real frame/size rules apply.
    vae = AutoencoderKLWan(
        base_dim=3,
        z_dim=16,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
    )

    torch.manual_seed(seed)
    # rope_max_seq_len bounds latent positions per axis: 32 covers up to 125 frames and 512 px.
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=16,
        out_channels=16,
        text_dim=32,
        freq_dim=256,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )

    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    pipe: Any = WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        scheduler=scheduler,
        transformer=transformer,
    )
    # Save beside the target and rename, so a reader never sees a half-written pipeline.
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = folder.parent / f".{folder.name}.building-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        pipe.save_pretrained(staging)
        if folder.exists():
            shutil.rmtree(folder)
        staging.rename(folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def is_pipeline_folder(folder: Path) -> bool:
    """Whether `folder` already holds a saved diffusers pipeline."""
    return (Path(folder) / "model_index.json").is_file()


def default_folder() -> Path:
    """Where the tiny model lives by default: <TASKGATE_STATE_DIR or .taskgate>/models/wan-tiny."""
    return Path(os.environ.get("TASKGATE_STATE_DIR") or ".taskgate") / "models" / MODEL_NAME


def main(argv: list[str] | None = None) -> int:
    """Command line: build the tiny model unless it is already there."""
    parser = argparse.ArgumentParser(prog="python -m taskgate_local.tinymodel", description=__doc__)
    parser.add_argument("--out", type=Path, default=None, help="target folder (default: <state dir>/models/wan-tiny)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed")
    parser.add_argument("--force", action="store_true", help="rebuild even if the folder holds a pipeline")
    args = parser.parse_args(argv)
    out: Path = args.out if args.out is not None else default_folder()
    if is_pipeline_folder(out) and not args.force:
        print(f"{out}: pipeline already present")
        return 0
    build_tiny_pipeline(out, seed=args.seed)
    print(f"{out}: built {MODEL_NAME}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
