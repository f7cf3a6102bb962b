"""The smoke run: build a small preset, prefill a mixed image + text prompt, decode, and measure what a
serving engineer looks at.

The prompt is one image (a procedurally drawn shape unless the caller passes one) followed by text, in
one sequence. Returns a SmokeReport with parameters, prefill / decode throughput, per-layer expert load
(also split by text and image tokens) and cache bytes; `report_sections` turns it into text and captioned
plotly figures for the HTML report.

Throughput: one cold timing of a tiny model swings several-fold between runs (first-call allocations,
thread start-up, other load on the machine). So the run uses a fixed thread count, does one untimed
warm-up pass (which also records the expert load and the greedy tokens), then times `repeats` passes
from an empty cache and reports the median, with the spread and the environment it ran in.
"""
from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from latentmoe_lab.config import ModelConfig
from latentmoe_lab.layers.moe import LatentMoE
from latentmoe_lab.meta import count_parameters, format_bytes, format_count
from latentmoe_lab.model import LatentMoEForCausalLM
from latentmoe_lab.multimodal import IMAGE_MARKER, ImageTextProcessor, ModalityRouting, make_sample, unpatchify
from latentmoe_lab.multimodal.routing_stats import routing_by_modality
from latentmoe_lab.report import Captioned
from latentmoe_lab import viz
from latentmoe_lab.viz import multimodal as viz_multimodal

DEFAULT_PROMPT = ("LatentMoE Lab smoke run: three KDA blocks for every Gated DSA block, "
                  "sixteen of many latent experts per token, one shared sequence for text and images.")


@dataclass
class SmokeReport:
    preset: str
    params: dict
    prompt_tokens: int
    new_tokens: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    expert_load: dict[str, list[int]]  # layer label -> tokens per expert (prefill + decode)
    cache_bytes: dict[str, int]
    generated_text: str
    image_tokens: int  # placeholders in the prompt (the rest of prompt_tokens is text)
    image: torch.Tensor  # [3, H, W] in [0, 1], as the vision tower saw it (resized to whole merge windows)
    patch_size: int
    merge_size: int
    modality: ModalityRouting  # prefill routing split by text / image tokens
    prompt_kinds: list[str]  # token kind per prompt position (text, image, image_start, image_end)
    prefill_seconds: list[float]  # one per timed repeat, after the warm-up
    decode_seconds: list[float]
    environment: dict  # torch, python, cpu, threads, seed, repeats

    @staticmethod
    def spread(seconds: list[float]) -> float:
        """max / min over the repeats: 1.0 is perfectly stable."""
        return max(seconds) / min(seconds)

    def max_over_mean(self) -> dict[str, float]:
        return {layer: max(c) / (sum(c) / len(c)) for layer, c in self.expert_load.items() if sum(c)}

    def summary(self) -> str:
        lines = [
            f"preset {self.preset}: {format_count(self.params['total'])} parameters, "
            f"{format_count(self.params['active'])} active per token",
            f"prompt: {self.prompt_tokens} tokens = {self.image_tokens} image + "
            f"{self.prompt_tokens - self.image_tokens} text (a {self.image.shape[1]}x{self.image.shape[2]} image, "
            f"patch {self.patch_size}, {self.merge_size}x{self.merge_size} merge)",
            f"prefill: {self.prompt_tokens} tokens at {self.prefill_tokens_per_s:,.0f} tokens/s "
            f"(median of {len(self.prefill_seconds)} after a warm-up; max/min {self.spread(self.prefill_seconds):.2f})",
            f"decode:  {self.new_tokens} tokens at {self.decode_tokens_per_s:,.1f} tokens/s "
            f"(median of {len(self.decode_seconds)}; max/min {self.spread(self.decode_seconds):.2f})",
            "environment: " + ", ".join(f"{k} {v}" for k, v in self.environment.items()),
            "expert load (max/mean tokens per expert):",
        ]
        lines += [f"  {layer}: {ratio:.2f}" for layer, ratio in self.max_over_mean().items()]
        lines.append("routing by modality (prefill): " + self.modality.summary())
        lines.append("cache bytes: " + ", ".join(f"{k} {format_bytes(v)}" for k, v in self.cache_bytes.items())
                     + f" (total {format_bytes(sum(self.cache_bytes.values()))})")
        lines.append(f"generated (random weights, so noise): {self.generated_text!r}")
        return "\n".join(lines)


def cpu_name() -> str:
    """The CPU model as the OS names it (Linux /proc/cpuinfo), else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def run_environment(threads: int, seed: int, repeats: int) -> dict:
    """What a throughput figure depends on, recorded next to it."""
    return {"torch": torch.__version__, "python": platform.python_version(), "cpu": cpu_name(),
            "threads": threads, "seed": seed, "repeats": repeats}


@torch.no_grad()
def _prefill_and_decode(model: LatentMoEForCausalLM, batch, new_tokens: int):
    """One pass from an empty cache -> (prefill seconds, decode seconds, greedy token ids, the cache)."""
    cache = model.new_cache()
    start = time.perf_counter()
    logits = model(**batch.model_inputs(), cache=cache).logits[:, -1]
    prefill_s = time.perf_counter() - start
    generated = []
    start = time.perf_counter()
    for _ in range(new_tokens):
        next_token = logits.argmax(dim=-1, keepdim=True)
        generated.append(int(next_token))
        logits = model(next_token, cache=cache).logits[:, -1]
    return prefill_s, time.perf_counter() - start, generated, cache


def run_smoke(preset: str = "tiny", prompt: str = DEFAULT_PROMPT, new_tokens: int = 16, seed: int = 0,
              progress: Callable[[str], None] = lambda message: None, image=None, threads: int = 1,
              repeats: int = 5) -> SmokeReport:
    """Build `preset` with seeded random weights, prefill image + `prompt`, greedy-decode `new_tokens` tokens.

    image: a PIL image, file path or tensor [3, H, W]; None draws a 112x112 shape (16 image tokens).
    It goes where `prompt` has an "<image>" marker, or first when the prompt has none.
    threads: torch intra-op threads for the run (restored afterwards); repeats: timed passes after the warm-up.
    """
    for name, value in (("new_tokens", new_tokens), ("threads", threads), ("repeats", repeats)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: must be >= 1, got {value!r}")
    if isinstance(image, (str, Path)) and not Path(image).is_file():
        raise FileNotFoundError(f"image: no such file: {str(image)!r}")
    config = ModelConfig.from_preset(preset)
    # The prompt (and so the image file) is read before the model is built: a bad image fails in milliseconds.
    processor = ImageTextProcessor(config)
    if image is None:
        image = make_sample("shape", size=112, generator=torch.Generator().manual_seed(seed)).image
    batch = processor(prompt if IMAGE_MARKER in prompt else IMAGE_MARKER + prompt, [image])
    input_ids = batch.input_ids
    progress(f"building the {preset} preset")
    torch.manual_seed(seed)
    model = LatentMoEForCausalLM(config).eval()
    params = count_parameters(config)

    moe_layers = {f"layer {i}": block.ffn for i, block in enumerate(model.layers) if isinstance(block.ffn, LatentMoE)}
    load = {label: torch.zeros(config.moe.num_experts, dtype=torch.int64) for label in moe_layers}

    def count_load(label):
        def hook(module, args, output):
            load[label] += module.last_expert_counts  # a hook that returned a value would replace the output
        return hook

    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        progress(f"warm-up: prefill of {input_ids.shape[1]} tokens, {new_tokens} decode steps (records the load)")
        hooks = [moe.register_forward_hook(count_load(label)) for label, moe in moe_layers.items()]
        try:
            _, _, generated, cache = _prefill_and_decode(model, batch, new_tokens)
        finally:
            for hook in hooks:
                hook.remove()
        progress(f"timing {repeats} passes")
        timed = [_prefill_and_decode(model, batch, new_tokens)[:2] for _ in range(repeats)]
    finally:
        torch.set_num_threads(previous_threads)
    prefill_seconds, decode_seconds = [t[0] for t in timed], [t[1] for t in timed]
    progress("splitting the prefill routing by modality")
    vision = config.vision
    kinds = {vision.image_token_id: "image", vision.image_start_id: "image_start", vision.image_end_id: "image_end"}
    return SmokeReport(
        preset=preset, params=params, prompt_tokens=input_ids.shape[1], new_tokens=new_tokens,
        prefill_tokens_per_s=input_ids.shape[1] / statistics.median(prefill_seconds),
        decode_tokens_per_s=new_tokens / statistics.median(decode_seconds),
        expert_load={label: counts.tolist() for label, counts in load.items()},
        cache_bytes=cache.nbytes_by_kind(), generated_text=processor.decode(generated),
        image_tokens=int((input_ids == vision.image_token_id).sum()),
        image=unpatchify(batch.pixel_values, tuple(batch.image_grids[0].tolist()), vision.patch_size,
                         vision.merge_size, vision.in_channels),
        patch_size=vision.patch_size, merge_size=vision.merge_size, modality=routing_by_modality(model, batch),
        prompt_kinds=[kinds.get(i, "text") for i in input_ids[0].tolist()],
        prefill_seconds=prefill_seconds, decode_seconds=decode_seconds,
        environment=run_environment(threads, seed, repeats),
    )


def report_sections(report: SmokeReport) -> list:
    """The summary text and one captioned figure per topic, for `report.write_html_report`."""
    labels = list(report.expert_load)
    text_share, image_share = report.modality.fractions()
    return [
        report.summary(),
        Captioned(viz_multimodal.patch_grid_figure(
            report.image, report.patch_size, report.merge_size,
            title="The prompt's image: patches, merge windows, one token per window"),
            f"The image as the vision tower saw it, resized to whole merge windows. Thin lines cut it into "
            f"{report.patch_size}x{report.patch_size} patches; each {report.merge_size}x{report.merge_size} window "
            f"(thick lines) becomes one token of the sequence, numbered in sequence order."),
        Captioned(viz_multimodal.sequence_layout_figure(
            [report.prompt_kinds], row_labels=["prompt"],
            title="The mixed prompt: image and text tokens in one sequence"),
            "Token kinds along the prompt: the image tokens sit between their start and end markers, then the "
            "text follows; both go through the same attention layers and the same experts."),
        Captioned(viz_multimodal.modality_routing_figure(text_share, image_share, report.modality.layer_labels),
                  "Per MoE layer (first layer on top), the share of each modality's expert assignments during the "
                  "prefill: text, image, and image minus text (red: image tokens favour that expert)."),
        Captioned(viz.parameter_breakdown_figure(report.params["by_component"],
                                                 title=f"Parameters ({report.preset})"),
                  "Total against active-per-token parameters by component, on a log scale: the routed experts "
                  "hold most of the total, and only the top-k of them are active for a token."),
        Captioned(viz.expert_load_figure([report.expert_load[k] for k in labels], labels),
                  "Tokens sent to each expert in each MoE layer (first layer on top, as above) over the prefill "
                  "and the decode of the warm-up pass."),
        Captioned(viz.load_imbalance_figure([report.max_over_mean().get(k, 0.0) for k in labels], labels),
                  "The busiest expert's load over the mean load, per MoE layer: 1.0 is perfect balance. Random "
                  "weights and no balancing steps, so some skew is expected."),
        Captioned(viz.cache_bytes_figure(report.cache_bytes),
                  "Bytes the hybrid cache holds after the prompt and the decode, by kind: the KDA conv tail and "
                  "fp32 state do not grow with the sequence; the DSA latent, rope key and index key do."),
    ]
