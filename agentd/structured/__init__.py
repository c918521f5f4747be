"""Structured outputs: tool calls, JSON and regexes that always parse (grammar-constrained
decoding). ``params`` says what a request asks for (pure Python); ``compiler`` turns it into a
cached grammar; ``matchers`` masks each step's logits on the engine thread."""

from agentd.structured.params import (
    FunctionSpec,
    GrammarError,
    StructuredOutputsParams,
    ToolCallsSpec,
    strict_schema,
)

__all__ = ["FunctionSpec", "GrammarError", "StructuredOutputsParams", "ToolCallsSpec",
           "strict_schema"]
