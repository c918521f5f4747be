"""Offline API in vLLM's shape: ``LLM(model).generate(prompts, params)`` and ``LLM.chat``.

Invariant: outputs come back one per prompt, in the order given, whatever order they finished in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from agentd.config import EngineConfig, SpeculativeConfig, parse_size
from agentd.engine.llm_engine import LLMEngine
from agentd.engine.outputs import RequestOutput
from agentd.engine.request import EngineRequest
from agentd.engine.sampling_params import SamplingParams

PromptLike = str | list[int]


def engine_config(model: str | None = None, **engine_args: Any) -> EngineConfig:
    """Build an EngineConfig, accepting ``kv_cache_memory="2GiB"`` and ``speculative="off"``
    like the CLI does."""
    if "kv_cache_memory" in engine_args:
        engine_args["kv_cache_memory_bytes"] = parse_size(engine_args.pop("kv_cache_memory"))
    if isinstance(engine_args.get("speculative"), str):  # "ngram" or "off", with defaults
        engine_args["speculative"] = SpeculativeConfig(method=engine_args["speculative"])
    return EngineConfig(model=model, **engine_args)


class LLM:
    """Run the engine in-process. ``model=None`` is the default model (SmolLM2-135M-Instruct)."""

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.engine = LLMEngine(engine_config(model, **engine_args))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: PromptLike | Sequence[PromptLike],
                 params: SamplingParams | None = None) -> list[RequestOutput]:
        """Run every prompt (text or token ids) to completion; one output per prompt, in order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = params or SamplingParams()
        token_lists = [self._encode(p) for p in prompts]
        return self._run(token_lists, params)

    def chat(self, messages: list[dict] | list[list[dict]], params: SamplingParams | None = None,
             tools: list[dict] | None = None, tool_choice: str | dict | None = None,
             parallel_tool_calls: bool | None = None) -> list[RequestOutput]:
        """Render conversations through the chat template, then generate.

        With ``tools`` (OpenAI format) the turn is constrained as the server constrains it:
        every ``<tool_call>`` in the output names one of them with valid arguments
        (``agentd.tool_parser.parse_tool_calls`` splits the text); ``tool_choice`` "required"
        or a named function makes the turn calls only, "none" renders no tools.
        """
        from agentd.chat import render_chat
        from agentd.structured.params import tool_calls_params

        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        token_lists = [render_chat(self.tokenizer, list(conv), tools, tool_choice).prompt_token_ids
                       for conv in conversations]
        params = params or SamplingParams()
        constraint = tool_calls_params(tools or [], tool_choice, parallel_tool_calls)
        if constraint is not None and params.structured_outputs is None:
            params = dataclasses.replace(params, structured_outputs=constraint)
        return self._run(token_lists, params)

    def _encode(self, prompt: PromptLike) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer(prompt).input_ids
        return list(prompt)

    def _run(self, token_lists: list[list[int]], params: SamplingParams) -> list[RequestOutput]:
        engine = self.engine
        ids = [engine.add_request(EngineRequest(tokens, params)) for tokens in token_lists]
        results: dict[str, RequestOutput] = {
            rid: RequestOutput(rid, tokens, "", [], 0, None)
            for rid, tokens in zip(ids, token_lists, strict=True)
        }
        while engine.has_unfinished_requests():
            for delta in engine.step():
                out = results[delta.request_id]
                out.text += delta.text
                out.token_ids.extend(delta.token_ids)
                out.num_cached_tokens = delta.num_cached_tokens
                if delta.finished:
                    out.finish_reason = delta.finish_reason
                    out.stop_reason = delta.stop_reason
        return [results[rid] for rid in ids]
