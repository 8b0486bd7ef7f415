"""Structured outputs of a chat request: the grammar that `response_format` and a forced `tool_choice` impose.

The answer is decoded under an llguidance Lark grammar written in the North format itself:

  response_format json_object / json_schema   <|START_TEXT|> JSON under the schema <|END_TEXT|>
  tool_choice "required"                      <|START_ACTION|>[call, ...]<|END_ACTION|>, each call naming one of
                                              `tools` with arguments under that tool's parameters schema
  tool_choice {"function": {"name": f}}       <|START_ACTION|>[one call of f]<|END_ACTION|>
  tool_choice "auto" with a response_format   either of the first two

Reasoning stays free: when the prompt leaves the model inside <|START_THINKING|>, the grammar starts with any text
up to <|END_THINKING|> (a text lexeme cannot contain a special token), and constrains what follows. The model
was trained to reason before it calls a tool; skipping that (prefilling <|END_THINKING|>) made north-nano's
forced calls garbled in our trials (names right, arguments nonsense until max_tokens).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from megakernel.engine.grammar import StructuredOutputsParams, json_style_schema
from megakernel.north_format import END_ACTION, END_TEXT, END_THINKING, START_ACTION, START_TEXT
from megakernel.server.protocol import ChatCompletionRequest, JsonObjectFormat, JsonSchemaFormat, NamedToolChoice

ANY_OBJECT = {"type": "object"}


@dataclass
class Constraint:
    spec: StructuredOutputsParams
    param: str                      # the request field a grammar error is reported against


def _lit(text: str) -> str:
    return json.dumps(text)        # a Lark string literal


def _answer_rule(req: ChatCompletionRequest) -> tuple[str, str] | None:
    fmt = req.response_format
    if isinstance(fmt, JsonSchemaFormat):
        schema = fmt.json_schema.schema_
    elif isinstance(fmt, JsonObjectFormat):
        schema = ANY_OBJECT
    else:
        return None
    return (f"answer: {START_TEXT} answer_json {END_TEXT}\nanswer_json: %json {json_style_schema(schema)}\n",
            "response_format")


def _calls_rule(req: ChatCompletionRequest, names: list[str], parallel: bool) -> str:
    tools = {t.function.name: t.function.parameters or ANY_OBJECT for t in req.tools or []}
    more = '(", " call)* ' if parallel else ""
    lines = [f'calls: {START_ACTION} "[" call {more}"]" {END_ACTION}',
             'call: "{\\"tool_call_id\\": \\"" CALL_ID "\\", \\"tool_name\\": " (' +
             " | ".join(f"fn_{i}" for i in range(len(names))) + ') "}"',
             "CALL_ID: /[0-9]{1,2}/"]
    for i, name in enumerate(names):
        lines.append(f"fn_{i}: {_lit(json.dumps(name) + ', ' + json.dumps('parameters') + ': ')} args_{i}")
        lines.append(f"args_{i}: %json {json_style_schema(tools[name])}")
    return "\n".join(lines) + "\n"


def chat_constraint(req: ChatCompletionRequest, tools_enabled: bool, in_reasoning: bool) -> Constraint | None:
    """The grammar the answer to `req` must follow, or None when it is free."""
    c = _constraint(req, tools_enabled)
    if c is None or not in_reasoning:
        return c
    return Constraint(StructuredOutputsParams(grammar=c.spec.grammar.replace("start: ", REASONED, 1)), c.param)


REASONED = f"start: THINK {END_THINKING} "      # free reasoning first, then the constrained answer
THINK = "THINK: /(?s:.*)/\n"


def _constraint(req: ChatCompletionRequest, tools_enabled: bool) -> Constraint | None:
    choice = req.tool_choice if req.tool_choice is not None else "auto"
    answer = _answer_rule(req)
    forced = tools_enabled and (choice == "required" or isinstance(choice, NamedToolChoice))
    if not forced:
        if answer is None:
            return None
        rules, param = answer
        if tools_enabled:           # auto: the JSON answer, or calls of the tools
            names = [t.function.name for t in req.tools or []]
            return Constraint(StructuredOutputsParams(grammar="start: (answer | calls)\n" + THINK + rules +
                                                      _calls_rule(req, names, req.parallel_tool_calls is not False)),
                              "response_format")
        return Constraint(StructuredOutputsParams(grammar="start: answer\n" + THINK + rules), param)
    if isinstance(choice, NamedToolChoice):
        names, parallel = [choice.function.name], False
    else:
        names, parallel = [t.function.name for t in req.tools or []], req.parallel_tool_calls is not False
    return Constraint(StructuredOutputsParams(grammar="start: calls\n" + THINK + _calls_rule(req, names, parallel)),
                      "tools")
