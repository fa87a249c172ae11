"""Drive a vLLM peer (``bench/vllm_peer.py`` under another venv's Python) from our benchmarks, alternately with us.

The peer needs a Hugging Face folder: a GGUF model is converted once to an fp32 folder (transformers' GGUF reader,
the same weights our engine dequantizes) and cached, as the issue's side-by-side numbers were taken.

Between its calls the peer's process tree is stopped (SIGSTOP): idle, vLLM's engine-core loop still takes ~11% of a
core (measured: 1.09 CPU-s per 10 s), and on 2 cores that stalls our OpenMP threads (our runs were ~20% slower with
the peer idle beside them). Each engine then runs with nothing else on the machine.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Optional

from pagedllm.bench.vllm_peer import TAG


def hf_folder(model_path: str) -> str:
    """``model_path`` itself for an HF folder; for a ``.gguf`` file an fp32 HF folder converted once and cached."""
    if not model_path.endswith(".gguf"):
        return model_path
    import torch  # heavy: torch
    from transformers import AutoModelForCausalLM, AutoTokenizer  # heavy: transformers

    from pagedllm.bench.throughput import hf_fp32_model  # heavy: torch, not at CLI start
    from pagedllm.backend.builds import cache_root

    out = cache_root() / "peer-models" / (Path(model_path).stem + "-fp32")
    if not (out / "config.json").exists():
        d, f = os.path.dirname(model_path), os.path.basename(model_path)
        gguf_model = hf_fp32_model(model_path)
        config = gguf_model.config
        if hasattr(config, "quantization_config"):  # dequantized already; a GGUF-marked model refuses to save
            del config.quantization_config
        dense = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        dense.load_state_dict(gguf_model.state_dict())
        dense.save_pretrained(out)
        AutoTokenizer.from_pretrained(d, gguf_file=f).save_pretrained(out)
    return str(out)


def kv_pool_gib(engine: Any) -> int:
    """pagedllm's KV pool in whole GiB, rounded up (vLLM's CPU KV space is set in GiB)."""
    worker = engine.worker
    return max(1, math.ceil(worker.num_blocks * worker.bytes_per_block() / 2**30))


class VLLMPeer:
    """One long-lived vLLM ``LLM`` in a child process; ``generate``/``stream`` block until the peer replies."""

    def __init__(self, python: str, model_path: str, dtype: str, max_model_len: int, seed: int = 0,
                 max_num_seqs: Optional[int] = None, kv_cache_gib: int = 2):
        """``kv_cache_gib``: vLLM's KV pool (``VLLM_CPU_KVCACHE_SPACE``); callers pass pagedllm's (``kv_pool_gib``)
        so neither engine batches or preempts for want of KV the other had."""
        folder = hf_folder(model_path)
        args: dict[str, Any] = dict(model=folder, dtype=dtype, max_model_len=max_model_len, seed=seed,
                                    skip_tokenizer_init=not any(Path(folder).glob("tokenizer*")))
        if max_num_seqs:
            args["max_num_seqs"] = max_num_seqs
        ncpu = len(os.sched_getaffinity(0))
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "VLLM_CPU_OMP_THREADS_BIND": f"0-{ncpu - 1}",
               "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
        for k in ("PYTHONPATH", "OMP_NUM_THREADS"):  # our paths and thread caps are not the peer's
            env.pop(k, None)
        script = str(Path(__file__).with_name("vllm_peer.py"))
        self.log = open(os.environ.get("PAGEDLLM_PEER_LOG", os.devnull), "w")
        self.proc = subprocess.Popen([python, script, json.dumps(args)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
        t = time.perf_counter()
        ready = self._read()
        self.init_s = ready["init_s"]
        self.start_s = time.perf_counter() - t  # process start + imports + LLM() + warm-up
        self._signal(signal.SIGSTOP)

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(TAG):
                return json.loads(line[len(TAG):])
            self.log.write(line)
        raise RuntimeError(f"vLLM peer exited (code {self.proc.wait()}); set PAGEDLLM_PEER_LOG=FILE to see its log")

    def _tree(self) -> list[int]:
        """The peer and its descendants (vLLM's engine-core process), from /proc."""
        parents: dict[int, list[int]] = {}
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                try:
                    with open(f"/proc/{entry.name}/stat") as f:
                        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                except (OSError, ValueError, IndexError):
                    continue
                parents.setdefault(ppid, []).append(int(entry.name))
        tree, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            tree.append(pid)
            todo.extend(parents.get(pid, []))
        return tree

    def _signal(self, sig: int) -> None:
        for pid in self._tree():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def _call(self, **cmd) -> dict:
        self._signal(signal.SIGCONT)
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        out = self._read()
        self._signal(signal.SIGSTOP)
        if "error" in out:
            raise RuntimeError(f"vLLM peer: {out['error']}")
        return out

    def generate(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
        out = self._call(op="generate", prompts=prompts, max_tokens=max_tokens)
        return out["elapsed"], out["token_ids"]

    def stream(self, prompt: list[int], max_tokens: int) -> list[float]:
        """Seconds from submission to each new token of one request."""
        return self._call(op="stream", prompt=prompt, max_tokens=max_tokens)["stamps"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self._signal(signal.SIGCONT)
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except Exception:
                self.proc.kill()
        self.log.close()
