"""HF transformers' Trainer on a tiny randomly initialised GPT-2 (built from a config, no download),
launched by torchrun on CPU; rank 1's dataset returns a malformed example at one index."""

import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

FAIL_RANK = int(os.environ.get("SCENARIO_FAIL_RANK", "1"))


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.n = n
        self.rank = int(os.environ.get("RANK", "0"))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if self.rank == FAIL_RANK and i >= 40:
            raise KeyError(f"example {i}: 'input_ids' missing from the tokenized record")
        ids = torch.randint(0, 64, (16,))
        return {"input_ids": ids, "labels": ids.clone()}


def main() -> None:
    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(output_dir=os.environ.get("SCENARIO_OUT", "/tmp/hf-scenario"),
                             per_device_train_batch_size=4, max_steps=int(os.environ.get("SCENARIO_STEPS", "12")),
                             logging_steps=4, save_strategy="no", report_to=[], use_cpu=True,
                             dataloader_num_workers=0, disable_tqdm=True)  # fmt: skip
    Trainer(model=model, args=args, train_dataset=TokenDataset(400)).train()


if __name__ == "__main__":
    main()
