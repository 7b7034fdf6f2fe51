"""Supervised fine-tuning with TRL's SFTTrainer, roundpipe underneath.

Without arguments it runs anywhere (CPU devices included): a tiny random
Qwen3 model, a word-level tokenizer and generated text, a few steps. With a
checkpoint directory it fine-tunes that model in bf16 with fp32 optimizer
copies, on every GPU roundpipe finds:

    python examples/trainer_sft.py
    python examples/trainer_sft.py --model /path/to/Qwen3-0.6B --steps 100

The script is the plain SFTTrainer one with `SFTTrainer` replaced by
`RoundPipeSFTTrainer` (and its `roundpipe_config`).
"""
import argparse
import random
import tempfile

import datasets
import torch
import transformers
import trl

from roundpipe.integrations.transformers import RoundPipeConfig, RoundPipeSFTTrainer


def tiny_model_and_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, 256)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                                     unk_token="<unk>")
    config = transformers.Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      pad_token_id=0, eos_token_id=1)
    return transformers.Qwen3ForCausalLM(config), tokenizer


def generated_text(rows, seed=0):
    """Counting sequences ("w7 w8 w9 ..."): easy to learn, so the loss falls."""
    rng = random.Random(seed)
    out = []
    for _ in range(rows):
        start, length = rng.randrange(3, 200), rng.randrange(8, 40)
        out.append({"text": " ".join(f"w{start + i}" for i in range(min(length, 255 - start)))})
    return datasets.Dataset.from_list(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a causal LM checkpoint directory (default: a tiny random model)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--output-dir", default=None)
    parser.add_argument("--sync", action="store_true", help="synchronous optimizer steps (no one-step delay)")
    cli = parser.parse_args()

    if cli.model:
        model = transformers.AutoModelForCausalLM.from_pretrained(cli.model, dtype=torch.bfloat16)
        tokenizer = transformers.AutoTokenizer.from_pretrained(cli.model)
        optim_dtype = torch.float32  # fp32 optimizer copies of the bf16 weights
    else:
        torch.manual_seed(0)
        model, tokenizer = tiny_model_and_tokenizer()
        optim_dtype = None

    args = trl.SFTConfig(
        output_dir=cli.output_dir or tempfile.mkdtemp(), max_steps=cli.steps, per_device_train_batch_size=4,
        gradient_accumulation_steps=2, learning_rate=3e-3, lr_scheduler_type="cosine", warmup_steps=2,
        max_grad_norm=1.0, max_length=64, logging_steps=1, save_steps=cli.steps, report_to=[],
        bf16=False, disable_tqdm=True)
    trainer = RoundPipeSFTTrainer(
        model=model, args=args, train_dataset=generated_text(256), eval_dataset=generated_text(8, seed=1),
        processing_class=tokenizer,
        roundpipe_config=RoundPipeConfig(is_async=not cli.sync, optim_dtype=optim_dtype))
    trainer.train()
    print(trainer.evaluate())
    trainer.save_model()
    print("saved to", args.output_dir)


if __name__ == "__main__":
    main()
