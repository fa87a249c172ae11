"""``pagedllm bench mm-throughput``: offline throughput of a mixed image + text workload, pagedllm vs HF transformers.

The workload is seeded: half the prompts carry one or two generated PIL images (sizes drawn from ``--image-sizes``,
so the processor resizes several shapes), the other half are text only; every prompt has ``--input-words`` random
words and generates exactly ``--output-len`` tokens (greedy, EOS ignored). pagedllm runs it through ``LLM.generate``
(``multi_modal_data``: its engine runs the model's HF processor in-process); HF runs the same prompts and images
through the same processor and one batched ``generate`` (left padding, fp32 greedy, ``min_new_tokens``). Both times
include processing. Repeats alternate (ours, then HF's, on one warmed HF model); medians and the median per-repeat
ratio are reported, with the CPU model and thread count (say both beside any figure).

The model: a VLM folder (``--model``), or a seeded random one written once into ``--cache-dir`` from a preset of
:data:`VLM_PRESETS` (``--preset``; also ``pagedllm bench random-model --preset ...``): ``tiny-llava`` (seconds, for
checks) or ``llava-clip-b16-smollm2-135m`` (CLIP ViT-B/16 at 224 px + SmolLM2-135M's decoder: a small real VLM's
shape).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

# ChatML with image parts (llava-hf's convention): each {"type": "image"} part renders one ``<image>``.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>\n{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

_SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                     tie_word_embeddings=True)
#: name -> (what its shape is, CLIP vision fields, Llama text fields)
VLM_PRESETS: dict[str, tuple[str, dict, dict]] = {
    "tiny-llava": ("a tiny LLaVA (CLIP 84 px / 14 px patches: 36 image tokens, 2-layer decoder of width 64)",
                   dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=2,
                        image_size=84, patch_size=14, projection_dim=32),
                   dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=1, max_position_embeddings=2048, tie_word_embeddings=False)),
    "llava-clip-b16-smollm2-135m": ("LLaVA-style: CLIP ViT-B/16 at 224 px (196 image tokens) + SmolLM2-135M's "
                                    "decoder",
                                    dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                         num_attention_heads=12, image_size=224, patch_size=16,
                                         projection_dim=512),
                                    _SMOLLM2_135M),
}
DEFAULT_IMAGE_SIZES = "96x96,320x240,240x320,640x480"
_WORDS = ("the cat sat on a warm mat while rain fell over quiet hills and old stone bridges near the river "
          "describe this picture in detail what colours shapes objects can you see here").split()


@dataclass
class MMThroughputResult:
    model: str
    preset: Optional[str]
    cpu: str
    threads: int
    num_prompts: int
    num_with_images: int
    num_images: int
    image_sizes: list[str]
    input_words: int
    output_len: int
    repeats: int
    prompt_tokens: int = 0  # pagedllm's, placeholders expanded
    hf_prompt_tokens: Optional[int] = None
    generated_tokens: int = 0
    elapsed_s: list[float] = field(default_factory=list)
    output_tok_s: float = 0.0
    hf_elapsed_s: list[float] = field(default_factory=list)
    hf_output_tok_s: Optional[float] = None
    speedup_vs_hf: Optional[float] = None  # median of per-repeat ratios HF time / our time
    same_tokens_as_hf: Optional[float] = None  # fraction of prompts whose greedy tokens equal HF's (last repeat)


def add_parser(sub) -> None:
    p = sub.add_parser("mm-throughput", help="mixed image + text workload: pagedllm vs HF transformers generate "
                                             "(seeded, alternated repeats)")
    p.add_argument("--model", default=None, help="a VLM folder (default: the --preset model, written once)")
    p.add_argument("--preset", default="tiny-llava", choices=sorted(VLM_PRESETS),
                   help="random VLM shape used when --model is not given (default tiny-llava)")
    p.add_argument("--cache-dir", default=None,
                   help="where preset models are kept (default: $TMPDIR/pagedllm-bench-models)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-words", type=int, default=32, help="random words of text per prompt")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--image-sizes", default=DEFAULT_IMAGE_SIZES, help="WxH list the images' sizes are drawn from")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare-hf", action="store_true", help="also time HF transformers generate (alternated)")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--json", default=None, help="write the result as JSON here")
    p.set_defaults(func=main)


# ---- the model --------------------------------------------------------------------------------------------------
def write_random_vlm(preset: str, out: str, dtype: str = "float32", seed: int = 0) -> str:
    """Write the random LLaVA of ``preset`` (config, safetensors, the embedded SmolLM2 tokenizer plus ``<image>``,
    a PIL CLIP image processor, a chat template taking image parts) to ``out`` (a new folder); returns it."""
    import torch  # heavy: not at CLI start
    from transformers import (AutoTokenizer, CLIPVisionConfig, LlamaConfig, LlavaConfig,  # heavy: transformers
        LlavaForConditionalGeneration, LlavaProcessor)
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    from pagedllm.models.paths import default_model_path  # the embedded SmolLM2 GGUF: its tokenizer

    if os.path.exists(out):
        raise SystemExit(f"--out: {out} exists; give a new folder")
    shape, vision_kw, text_kw = VLM_PRESETS[preset]
    tok = AutoTokenizer.from_pretrained(os.path.dirname(default_model_path()),
                                        gguf_file=os.path.basename(default_model_path()))
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tok.chat_template = CHAT_TEMPLATE
    image_token = tok.convert_tokens_to_ids("<image>")
    size, patch = vision_kw["image_size"], vision_kw["patch_size"]
    tokens_per_image = (size // patch) ** 2
    vision = CLIPVisionConfig(hidden_act="quick_gelu", **vision_kw)
    text = LlamaConfig(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id, **text_kw)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_token,
                         image_seq_length=tokens_per_image, vision_feature_layer=-2,
                         vision_feature_select_strategy="default", projector_hidden_act="gelu")
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).to(getattr(torch, dtype))
    processor = LlavaProcessor(image_processor=CLIPImageProcessorPil(size={"shortest_edge": size},
                                                                     crop_size={"height": size, "width": size}),
                               tokenizer=tok, patch_size=patch, vision_feature_select_strategy="default",
                               num_additional_image_tokens=1, chat_template=CHAT_TEMPLATE)
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".random-vlm-", dir=parent)
    try:
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
        with open(os.path.join(tmp, "random_model.json"), "w") as f:  # how it was made, for whoever reads figures
            json.dump({"preset": preset, "shape": shape, "dtype": dtype, "seed": seed,
                       "parameters": sum(p.numel() for p in model.parameters())}, f, indent=1)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def preset_model(preset: str, cache_dir: Optional[str] = None) -> str:
    """The preset's folder under ``cache_dir``, written on first use (seed 0, float32)."""
    root = cache_dir or os.path.join(tempfile.gettempdir(), "pagedllm-bench-models")
    out = os.path.join(root, f"{preset}-seed0")
    if not os.path.isfile(os.path.join(out, "config.json")):
        try:
            write_random_vlm(preset, out)
        except OSError:  # another process wrote it first (rename onto an existing folder)
            if not os.path.isfile(os.path.join(out, "config.json")):
                raise
    return out


# ---- the workload -----------------------------------------------------------------------------------------------
def parse_sizes(text: str) -> list[tuple[int, int]]:
    sizes = []
    for item in text.split(","):
        w, sep, h = item.strip().lower().partition("x")
        if not sep or not w.isdigit() or not h.isdigit() or int(w) < 1 or int(h) < 1:
            raise SystemExit(f"--image-sizes: {item!r} is not WxH")
        sizes.append((int(w), int(h)))
    return sizes


def make_workload(num_prompts: int, input_words: int, sizes: list[tuple[int, int]], seed: int
                  ) -> list[tuple[str, list]]:
    """``(prompt text with one <image> per image, [PIL images])``: even prompts get one or two images of random
    content and a drawn size, odd ones none."""
    import numpy as np  # heavy: not at CLI start
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = []
    for i in range(num_prompts):
        images = []
        if i % 2 == 0:
            for _ in range(int(rng.integers(1, 3))):
                w, h = sizes[int(rng.integers(len(sizes)))]
                images.append(Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB"))
        words = " ".join(_WORDS[int(j)] for j in rng.integers(len(_WORDS), size=input_words))
        out.append(("<image>\n" * len(images) + words, images))
    return out


class HFVisionPeer:
    """HF transformers on the same prompts: the model's processor over the whole batch (left padding), then one
    batched greedy ``generate`` of exactly ``output_len`` tokens; fp32, warmed up once."""

    def __init__(self, model_path: str, workload: list[tuple[str, list]], output_len: int):
        import torch  # heavy: not at CLI start
        from transformers import AutoModelForImageTextToText, AutoProcessor  # heavy: transformers

        self.torch = torch
        self.model = AutoModelForImageTextToText.from_pretrained(model_path, dtype=torch.float32).eval()
        self.processor = AutoProcessor.from_pretrained(model_path, backend="pil")
        tok = self.processor.tokenizer
        tok.padding_side = "left"
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        self.workload = workload
        pad = self.processor.tokenizer.pad_token_id
        self.kw = dict(do_sample=False, max_new_tokens=output_len, min_new_tokens=output_len,
                       pad_token_id=pad if pad is not None else 0)
        self.prompt_tokens = 0
        self.tokens: list[list[int]] = []
        self.generate(workload[:2], 2)

    def generate(self, workload: Optional[list] = None, max_new: Optional[int] = None) -> float:
        torch = self.torch
        work = self.workload if workload is None else workload
        kw = self.kw if max_new is None else {**self.kw, "max_new_tokens": max_new, "min_new_tokens": max_new}
        with torch.inference_mode():
            t = time.perf_counter()
            images = [im for _, ims in work for im in ims]
            inputs = self.processor(text=[p for p, _ in work], images=images or None, return_tensors="pt",
                                    padding=True)
            out = self.model.generate(**inputs, **kw)
            elapsed = time.perf_counter() - t
        if workload is None:
            n = inputs["input_ids"].shape[1]
            self.prompt_tokens = int(inputs["attention_mask"].sum())
            self.tokens = out[:, n:].tolist()
        return elapsed


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


def run(args) -> MMThroughputResult:
    import torch  # heavy: not at CLI start

    from pagedllm import LLM, SamplingParams  # heavy: torch, not at CLI start

    model = args.model or preset_model(args.preset, args.cache_dir)
    sizes = parse_sizes(args.image_sizes)
    workload = make_workload(args.num_prompts, args.input_words, sizes, args.seed)
    res = MMThroughputResult(model=model, preset=None if args.model else args.preset, cpu=cpu_model(),
                             threads=torch.get_num_threads(), num_prompts=len(workload),
                             num_with_images=sum(1 for _, ims in workload if ims),
                             num_images=sum(len(ims) for _, ims in workload),
                             image_sizes=[f"{w}x{h}" for w, h in sizes], input_words=args.input_words,
                             output_len=args.output_len, repeats=args.repeats)
    kw = {"max_num_seqs": args.max_num_seqs} if args.max_num_seqs else {}
    llm = LLM(model, device="cpu", dtype="float32", **kw)
    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    prompts = [{"prompt": p, "multi_modal_data": {"image": ims}} if ims else p for p, ims in workload]
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    hf = HFVisionPeer(model, workload, args.output_len) if args.compare_hf else None
    ratios = []
    outs = None
    try:
        for _ in range(args.repeats):
            llm.llm_engine.kv.reset_prefix_cache()  # every repeat runs the same prefills
            t = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            res.elapsed_s.append(time.perf_counter() - t)
            if hf is not None:
                res.hf_elapsed_s.append(hf.generate())
                ratios.append(res.hf_elapsed_s[-1] / res.elapsed_s[-1])
    finally:
        llm.shutdown()
    res.prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    res.generated_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    res.output_tok_s = res.generated_tokens / statistics.median(res.elapsed_s)
    if hf is not None:
        res.hf_prompt_tokens = hf.prompt_tokens
        res.hf_output_tok_s = sum(map(len, hf.tokens)) / statistics.median(res.hf_elapsed_s)
        res.speedup_vs_hf = statistics.median(ratios)
        same = sum(list(o.outputs[0].token_ids) == t for o, t in zip(outs, hf.tokens))
        res.same_tokens_as_hf = same / len(outs)
    return res


def report(res: MMThroughputResult) -> str:
    lines = [f"model {res.model}" + (f" (preset {res.preset})" if res.preset else ""),
             f"CPU {res.cpu}, {res.threads} threads",
             f"{res.num_prompts} prompts ({res.num_with_images} with {res.num_images} images of sizes "
             f"{', '.join(res.image_sizes)}), {res.input_words} words of text each, {res.output_len} tokens out; "
             f"{res.prompt_tokens} prompt tokens",
             f"pagedllm: {res.output_tok_s:.1f} tok/s (median of {res.repeats}: "
             f"{', '.join(f'{x:.2f}' for x in res.elapsed_s)} s)"]
    if res.hf_output_tok_s is not None:
        lines += [f"HF generate: {res.hf_output_tok_s:.1f} tok/s ({', '.join(f'{x:.2f}' for x in res.hf_elapsed_s)}"
                  f" s; {res.hf_prompt_tokens} prompt tokens)",
                  f"speedup vs HF: {res.speedup_vs_hf:.2f}x (median per-repeat ratio); greedy tokens equal to HF's "
                  f"on {res.same_tokens_as_hf:.0%} of prompts"]
    return "\n".join(lines)


def main(args) -> int:
    res = run(args)
    print(report(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(res), f, indent=1)
    return 0
