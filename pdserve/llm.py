"""Offline batch inference: `LLM(model_dir, **engine_args).generate(prompts, params)`, as vLLM's `LLM`."""
from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence, Union

from pdserve.config import EngineConfig
from pdserve.core.engine import LLMEngine
from pdserve.outputs import RequestOutput
from pdserve.sampling_params import RequestOutputKind, SamplingParams
from pdserve.worker.cpu_threads import adaptive_threads

PromptInput = Union[str, list[int], dict]


class LLM:
    def __init__(self, model: str, **engine_args):
        self.engine = LLMEngine(EngineConfig.from_kwargs(model, **engine_args))
        # a CPU engine gives up its extra threads while other processes want the cores (worker/cpu_threads.py)
        self.cpu_threads = adaptive_threads(self.engine.device.type, set_threads=self.engine.set_num_threads)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        return self.engine.default_sampling_params()

    def generate(self, prompts: Union[PromptInput, Sequence[PromptInput]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Prompts: a string, a list of token ids, {"prompt": str} / {"prompt_token_ids": [...]} (with vLLM's
        optional "cache_salt"), or a list of these. Returns one finished RequestOutput per prompt, in order."""
        prompts, salts = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        # One output per request, at its end: no per-step copies of what it generated so far (vLLM's LLM does too).
        params = [replace(sp, output_kind=RequestOutputKind.FINAL_ONLY) for sp in params]
        # n > 1: n requests (child i seeded seed + i), gathered into one output with n completions, by index
        groups: list[list[str]] = []
        try:
            for p, sp, salt in zip(prompts, params, salts):
                groups.append([])
                for i in range(sp.n):
                    groups[-1].append(self.engine.add_request(p, sp.child(i) if sp.n > 1 else sp,
                                                              cache_salt=salt).request_id)
        except BaseException:  # a prompt refused: none of the batch stays in the engine
            for rid in (r for g in groups for r in g):
                self.engine.abort_request(rid)
            raise
        done = self._run([rid for g in groups for rid in g], use_tqdm)
        return [done[g[0]] if len(g) == 1 else _gather(g, done) for g in groups]

    def chat(self, messages: Union[list[dict], list[list[dict]]],
             sampling_params: Optional[SamplingParams] = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or a list of them, rendered with the chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        prompts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=add_generation_prompt)
                   for c in conversations]
        return self.generate([{"prompt_token_ids": tok(p, add_special_tokens=False).input_ids, "prompt": p}
                              for p in prompts], sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> dict[str, RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and len(ids) > 1:
            from tqdm import tqdm
            bar = tqdm(total=len(ids), desc="Processed prompts", unit="req", dynamic_ncols=True)
        try:
            while self.engine.has_unfinished_requests():
                if self.cpu_threads is not None:
                    self.cpu_threads.poll()
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return done


def _gather(ids: list[str], done: dict[str, RequestOutput]) -> RequestOutput:
    """One output for a request of n > 1: its first child's, with every child's completion at its index."""
    first = done[ids[0]]
    outs = [replace(done[rid].outputs[0], index=i) for i, rid in enumerate(ids)]
    return replace(first, outputs=outs, finished=all(done[rid].finished for rid in ids))


def _as_prompt_list(prompts) -> tuple[list, list]:
    """(prompts, their cache salts)."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    out, salts = [], []
    for p in prompts:
        salts.append(p.get("cache_salt") if isinstance(p, dict) else None)
        if isinstance(p, dict):
            if "prompt_token_ids" in p:
                out.append(list(p["prompt_token_ids"]))
            elif "prompt" in p:
                out.append(p["prompt"])
            else:
                raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
        elif isinstance(p, (str, list)):
            out.append(p)
        else:
            raise ValueError(f"unsupported prompt type {type(p).__name__}")
    return out, salts
