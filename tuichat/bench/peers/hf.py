"""The model through plain transformers, in tuichat's dtype and device."""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

from tuichat.backends.local import chat_ids
from tuichat.backends.protocol import Message, TuichatError
from tuichat.bench.corpus import WARMUP_QUESTION
from tuichat.bench.stats import RequestResult
from tuichat.engine.heap import settle_heap


class HFPeer:
    """The model through plain transformers: generate, a padded static batch, generate_batch, a bare forward."""

    def __init__(self, resolved, device, dtype, device_map: str | None = None,
                 max_batched_tokens: int | None = None, mapped: bool = False) -> None:
        """`mapped`: a GGUF tuichat serves from its file (loader.in_place): transformers' layers then run over
        the same blocks, read in place by tuichat's kernels, instead of a converted bf16 copy."""
        import torch

        from tuichat.engine import loader
        from tuichat.engine.engine import eos_token_ids

        self.torch = torch
        # The same per-step token budget as tuichat's engine default (512 on a CPU, 8192 on CUDA).
        self.max_batched_tokens = max_batched_tokens or (8192 if torch.device(device).type == "cuda" else 512)
        self.model, self.tokenizer = loader.load(resolved, device, dtype, device_map, mapped=mapped)
        self.device = next(self.model.parameters()).device
        self.eos = sorted(eos_token_ids(self.model, self.tokenizer))  # the set the engine stops on
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos[0]
        self._warm: set[str] = set()

    # weights and time
    def weight_bytes(self) -> int:
        mapped = getattr(self.model, "tuichat_mapped", None)
        if mapped is not None:  # the linears' blocks (the embedding: only its rows a step looks up)
            return sum(w.bytes for w in mapped.packed.values())
        seen, total = set(), 0
        for p in self.model.parameters():  # tied embeddings / lm_head are read once per step
            if p.data_ptr() not in seen:
                seen.add(p.data_ptr())
                total += p.numel() * p.element_size()
        return total

    def _sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def _config(self, max_tokens: int):
        from transformers import GenerationConfig

        return GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=self.eos,
                                pad_token_id=self.pad)

    def _clock(self):
        from transformers import StoppingCriteria, StoppingCriteriaList

        torch = self.torch

        class Clock(StoppingCriteria):
            """Called by generate after every new token: a timestamp per step, never stops anything."""

            def __init__(self) -> None:
                self.times: list[float] = []

            def __call__(self, input_ids, scores, **kwargs):
                self.times.append(time.perf_counter())
                return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

        clock = Clock()
        return clock, StoppingCriteriaList([clock])

    def _count(self, row: list[int]) -> int:
        """Tokens up to and including the first EOS (the rest of a batch row is padding)."""
        for i, token in enumerate(row):
            if token in self.eos:
                return i + 1
        return len(row)

    def _warmup(self, kind: str) -> None:
        if kind in self._warm:
            return
        self._warm.add(kind)
        prompt = chat_ids(self.tokenizer, [Message("user", WARMUP_QUESTION)])
        if kind == "generate":
            self.generate(prompt, 4, warm=False)
        elif kind == "static":
            self.static_batch([prompt, prompt[:-2] or prompt], 4, warm=False)
        elif kind == "generate_batch":
            self.generate_batch([prompt, prompt], 4, warm=False)
        elif kind == "forward":
            self.bare_forward_ms(prompt, repeats=1, warm=False)

    def bare_forward_ms(self, prompt: list[int], repeats: int = 3, warm: bool = True) -> float:
        """Median time of one forward over the prompt, last position's logits only (what a prefill needs)."""
        torch = self.torch
        if warm:
            self._warmup("forward")
        ids = torch.tensor([prompt], device=self.device)
        times = []
        with torch.inference_mode():
            for _ in range(repeats):
                self._sync()
                start = time.perf_counter()
                self.model(input_ids=ids, use_cache=False, logits_to_keep=1)
                self._sync()
                times.append((time.perf_counter() - start) * 1000)
        return statistics.median(times)

    def generate(self, prompt: list[int], max_tokens: int, warm: bool = True) -> RequestResult:
        torch = self.torch
        if warm:
            self._warmup("generate")
        ids = torch.tensor([prompt], device=self.device)
        clock, criteria = self._clock()
        result = RequestResult(submitted=time.perf_counter(), prompt_tokens=len(prompt))
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=self._config(max_tokens),
                                      stopping_criteria=criteria)
        result.finished = time.perf_counter()
        row = out[0, len(prompt):].tolist()
        result.tokens = self._count(row)
        result.set_token_times(clock.times[: result.tokens])
        result.text = self.tokenizer.decode(row[: result.tokens], skip_special_tokens=True)
        return result

    def static_batch(self, prompts: list[list[int]], max_tokens: int, warm: bool = True,
                     stagger_s: float = 0.0) -> tuple[list[RequestResult], float]:
        """One left-padded batch through generate; it runs until the longest reply ends. Prompt i arrives at
        i * stagger_s: a static batch can only start once its last member is there, and each request's
        TTFT counts from its own arrival."""
        torch = self.torch
        if warm:
            self._warmup("static")
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        clock, criteria = self._clock()
        first_arrival = time.perf_counter()
        time.sleep(stagger_s * (len(prompts) - 1))
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=mask, generation_config=self._config(max_tokens),
                                      stopping_criteria=criteria)
        end = time.perf_counter()
        results = []
        for i, prompt in enumerate(prompts):
            arrived = first_arrival + i * stagger_s
            r = RequestResult(submitted=arrived, prompt_tokens=len(prompt), finished=end)
            r.tokens = self._count(out[i, width:].tolist())
            r.set_token_times(clock.times[: r.tokens])
            results.append(r)
        return results, end - first_arrival

    def generate_batch(self, prompts: list[list[int]], max_tokens: int, warm: bool = True,
                       stagger_s: float = 0.0) -> tuple[list[RequestResult], float]:
        """transformers' own continuous batching: the manager behind `generate_batch` (a thread, its own paged
        cache), with prompt i added at i * stagger_s, as tuichat gets them."""
        if warm:
            self._warmup("generate_batch")
        from transformers import ContinuousBatchingConfig

        # Left alone, it sizes its KV cache to 90 % of free memory (host RAM on a CPU), allocated on every call.
        # Give it what the workload needs and the engine's per-step token budget.
        cb = ContinuousBatchingConfig()
        cb.num_blocks = math.ceil(sum(len(p) + max_tokens for p in prompts) / cb.page_size) + len(prompts)
        cb.max_batch_tokens = self.max_batched_tokens
        attn = getattr(self.model.config, "_attn_implementation", None)
        done: dict[str, Any] = {}
        arrivals: dict[str, float] = {}
        try:
            with self.model.continuous_batching_context_manager(
                generation_config=self._config(max_tokens), continuous_batching_config=cb, block=True, timeout=5
            ) as manager:
                start = time.perf_counter()
                for i, prompt in enumerate(prompts):
                    time.sleep(max(0.0, start + i * stagger_s - time.perf_counter()))
                    arrivals[f"tab{i}"] = time.perf_counter()
                    manager.add_request(prompt, request_id=f"tab{i}", max_new_tokens=max_tokens, record_timestamps=True)
                while len(done) < len(prompts):
                    output = manager.get_result(timeout=1)
                    if output is not None and output.is_finished():
                        done[output.request_id] = output
                    elif output is None and not manager.is_running():
                        raise TuichatError("transformers' continuous batching stopped before finishing the tabs.")
                end = time.perf_counter()
        finally:
            if attn and getattr(self.model.config, "_attn_implementation", None) != attn:
                self.model.set_attn_implementation(attn)  # it may switch to a paged kernel; later peers get theirs back
        results = []
        for request_id, arrived in arrivals.items():
            output = done[request_id]
            if output.error:
                raise TuichatError(f"transformers generate_batch failed: {output.error}")
            r = RequestResult(submitted=arrived, prompt_tokens=len(output.prompt_ids), finished=end)
            r.tokens = len(output.generated_tokens)
            r.set_token_times(output.timestamps or [])
            results.append(r)
        return results, end - start

    def close(self) -> None:
        self.model = None
        settle_heap()  # collect what was closed; freeze what stays
        if self.device.type == "cuda":
            self.torch.cuda.empty_cache()
