"""A tiny visual question answering run on CPU: does the model learn to read the pixels?

Each step draws fresh synthetic samples (latentmoe_lab.multimodal.synthetic), so the model cannot
memorise; the loss is the cross-entropy of the answer tokens only (the question text is the same
for every sample of a kind and would make the loss fall without any seeing). Accuracy is measured on
held-out samples from the first answer token, restricted to the answers possible for the question,
and compared with chance (1 / number of answers).

The loss over all answer tokens falls fast even for a blind model: after the first letter the rest
of the word is fixed. The first answer token's loss is the informative curve; a model that ignores
the image cannot push it below the chance level, the mean over samples of ln(number of answers).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from latentmoe_lab.multimodal.processor import ImageTextProcessor, MultimodalBatch
from latentmoe_lab.multimodal.synthetic import ANSWERS, SyntheticSample, chance_accuracy, make_samples

IGNORE = -100


@dataclass
class TrainingResult:
    """Per-step losses (all answer tokens, first answer token); accuracies on the same held-out samples."""

    losses: list[float]
    first_token_losses: list[float]
    chance_loss: float
    accuracy_before: float
    accuracy_after: float
    chance: float
    seconds: float
    accuracy_by_kind: dict[str, float] = field(default_factory=dict)

    def summary(self) -> str:
        by_kind = ", ".join(f"{kind} {acc:.0%}" for kind, acc in self.accuracy_by_kind.items())
        return (f"{len(self.losses)} steps in {self.seconds:.1f} s: answer loss {self.losses[0]:.2f} -> "
                f"{_tail_mean(self.losses):.2f}, first answer token {self.first_token_losses[0]:.2f} -> "
                f"{_tail_mean(self.first_token_losses):.2f} (chance level {self.chance_loss:.2f});\n"
                f"held-out accuracy {self.accuracy_before:.0%} -> {self.accuracy_after:.0%} ({by_kind}); "
                f"chance {self.chance:.0%}")


def answer_batch(processor: ImageTextProcessor,
                 samples: list[SyntheticSample]) -> tuple[MultimodalBatch, torch.Tensor]:
    """Padded batch of full sequences and next-token labels [B, T] that score only the answer tokens."""
    batch = processor([s.text for s in samples], [[s.image] for s in samples])
    labels = torch.full_like(batch.input_ids, IGNORE)
    for row, (sample, length) in enumerate(zip(samples, batch.lengths)):
        answer_len = len(sample.text.encode("utf-8")) - len(sample.prompt.encode("utf-8"))
        # logits at t predict token t + 1: the answer's tokens sit at [length - answer_len, length)
        labels[row, length - answer_len - 1:length - 1] = batch.input_ids[row, length - answer_len:length]
    return batch, labels


def answer_losses(model, batch: MultimodalBatch, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean cross-entropy over all answer tokens, mean cross-entropy of each sample's first answer token)."""
    logits = model(**batch.model_inputs()).logits
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE)
    first = (labels != IGNORE).int().argmax(dim=1)  # position whose logits predict the first answer token
    rows = torch.arange(labels.shape[0])
    return loss, F.cross_entropy(logits[rows, first].detach(), labels[rows, first])


@torch.no_grad()
def answer_predictions(model, processor: ImageTextProcessor, samples: list[SyntheticSample]) -> list[str]:
    """For each sample, the possible answer whose first token the model scores highest after the prompt."""
    batch = processor([s.prompt for s in samples], [[s.image] for s in samples])
    logits = model(**batch.model_inputs()).logits
    last = logits[torch.arange(len(samples)), torch.tensor(batch.lengths) - 1]  # [B, vocab]
    predictions = []
    for row, sample in zip(last, samples):
        options = ANSWERS[sample.kind]
        first_tokens = torch.tensor([option.encode("utf-8")[0] for option in options])
        predictions.append(options[int(row[first_tokens].argmax())])
    return predictions


def answer_accuracy(model, processor: ImageTextProcessor, samples: list[SyntheticSample]) -> dict[str, float]:
    """{"all": accuracy, kind: accuracy per question kind} over `samples`."""
    correct = [p == s.answer for p, s in zip(answer_predictions(model, processor, samples), samples)]
    result = {"all": sum(correct) / len(correct)}
    for kind in dict.fromkeys(s.kind for s in samples):
        hits = [c for c, s in zip(correct, samples) if s.kind == kind]
        result[kind] = sum(hits) / len(hits)
    return result


def train_vqa(model, processor: ImageTextProcessor, steps: int = 200, batch_size: int = 16, lr: float = 3e-3,
              kinds: tuple[str, ...] = ("colour", "shape"), image_size: int = 28, eval_size: int = 96,
              seed: int = 0) -> TrainingResult:
    """Train `model` in place with AdamW on fresh synthetic samples; return the loss curve and accuracies."""
    if steps < 1 or batch_size < 1 or eval_size < 1:
        raise ValueError(f"steps, batch_size, eval_size: must be >= 1, got {steps}, {batch_size}, {eval_size}")
    held_out = make_samples(eval_size, kinds, image_size, seed=seed + 1_000_003)
    model.eval()
    accuracy_before = answer_accuracy(model, processor, held_out)["all"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses, first_token_losses = [], []
    start = time.perf_counter()
    model.train()
    for step in range(steps):
        samples = make_samples(batch_size, kinds, image_size, seed=seed + step)
        loss, first_token_loss = answer_losses(model, *answer_batch(processor, samples))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        first_token_losses.append(first_token_loss.item())
    seconds = time.perf_counter() - start
    model.eval()
    accuracy = answer_accuracy(model, processor, held_out)
    chance_loss = sum(math.log(len(ANSWERS[s.kind])) for s in held_out) / len(held_out)
    return TrainingResult(losses=losses, first_token_losses=first_token_losses, chance_loss=chance_loss,
                          accuracy_before=accuracy_before, accuracy_after=accuracy.pop("all"),
                          chance=chance_accuracy(held_out), seconds=seconds, accuracy_by_kind=accuracy)


def _tail_mean(values: list[float], window: int = 10) -> float:
    tail = values[-window:]
    return sum(tail) / len(tail)
