"""The request bodies of specdec's OpenAI-compatible server: typed pydantic models of the two
endpoints (FastAPI validates each body against one before it is queued), the one place that turns
a validation failure into a 400 naming the field (`invalid`), and the structured-output fields of a
request read as a specdec Grammar (`Params.grammar`).

Every check that needs only the request is made here, once: types and ranges by the fields, and
the server's own refusals (n, k, logprobs, logit_bias, unsupported fields, structured output) by
validators raising `refuse(...)`, answered with their message as is. What needs the model (the
prompt's tokens, the context, logit_bias' token ids, the drafters, the grammar's compile) is
specdec.serve.server's.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    StrictFloat,
    StrictInt,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from specdec.grammar import Grammar, GrammarError
from specdec.options import MAX_TOP_LOGPROBS
from specdec.serve.errors import ApiError

MAX_STOP = 16  # stop strings per request
MAX_N = 16  # choices per request
REFUSED = "refused"  # the error type of refuse(): answered with its own message, param and code


def refuse(message: str, param: str, code: str = "invalid_parameter") -> PydanticCustomError:
    """A validator's refusal of a request: `invalid` answers it as ApiError(400, message, code=code,
    param=param), word for word (raise what this returns)."""
    return PydanticCustomError(REFUSED, "{message}", {"message": message, "param": param, "code": code})


class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class _Strict(BaseModel):
    """An object inside a request: a key the server does not know is refused (400), never dropped."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class _SchemaSpec(_Strict):
    """OpenAI's response_format.json_schema: the schema the output must follow (name, description
    and strict are read and kept to OpenAI's shape; the schema is always enforced)."""

    name: str
    schema_: dict = Field(alias="schema")
    description: str | None = None
    strict: StrictBool | None = None


class _ResponseFormat(_Strict):
    """OpenAI's response_format: {"type": "text"} (free text), {"type": "json_object"} or
    {"type": "json_schema", "json_schema": {...}}."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: _SchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema comes with "type": "json_schema", and only with it')
        return self


class _StructuredOutputs(_Strict):
    """vLLM's structured_outputs: exactly one of json (a schema, or its JSON text), regex, choice,
    grammar (Lark, llguidance's dialect) or json_object = true."""

    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: StrictBool | None = None


class Params(BaseModel):
    """The fields both endpoints share. A field the server does not know is refused (400), never
    silently dropped, and so is an unknown key inside response_format or structured_outputs.
    Numbers and booleans must come as JSON numbers and booleans (as OpenAI's API requires), not
    strings."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    model: str | None = None
    max_tokens: StrictInt | None = Field(None, ge=0)
    temperature: StrictFloat | None = Field(None, ge=0)
    top_p: StrictFloat | None = Field(None, gt=0, le=1)
    top_k: StrictInt | None = Field(None, ge=0)  # extension (vLLM has it too); 0 = off
    seed: StrictInt | None = Field(None, ge=-(2**63), le=2**64 - 1)  # what torch.Generator.manual_seed takes
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: _StreamOptions | None = None
    n: StrictInt | None = None
    logprobs: StrictBool | StrictInt | None = None  # chat: true/false; completions: 0..20 alternatives
    top_logprobs: StrictInt | None = None  # chat: 0..20 alternatives
    frequency_penalty: StrictFloat | None = Field(None, ge=-2, le=2)
    presence_penalty: StrictFloat | None = Field(None, ge=-2, le=2)
    repetition_penalty: StrictFloat | None = Field(None, gt=0)  # extension (vLLM's); 1 = off
    logit_bias: dict[str, StrictFloat] | None = None  # {"token id": bias in [-100, 100]}
    min_p: StrictFloat | None = Field(None, ge=0, le=1)  # extension (vLLM's); 0 = off
    stop_token_ids: list[Annotated[StrictInt, Field(ge=0)]] | None = None  # extension (vLLM's)
    ignore_eos: StrictBool = False  # extension (vLLM's)
    response_format: _ResponseFormat | None = None
    structured_outputs: _StructuredOutputs | None = None  # vLLM's
    guided_json: dict | str | None = None  # vLLM's older fields, one each
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    drafter: str | None = None  # extension: a drafter this server has, or "none"
    k: StrictInt | str | None = None  # extension: draft length, or "auto" ("4" is read as 4)
    _grammar: tuple[Grammar | None, str | None] = PrivateAttr((None, None))

    @property
    def grammar(self) -> Grammar | None:
        """The grammar the output must follow (structured output), or None for free text."""
        return self._grammar[0]

    @property
    def grammar_field(self) -> str | None:
        """The field that asked for the grammar (response_format, guided_json, ...), or None."""
        return self._grammar[1]

    @field_validator("stop")
    @classmethod
    def _few_stop_strings(cls, v):
        if isinstance(v, list) and len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings, got {len(v)}")
        return v

    @field_validator("n")
    @classmethod
    def _few_choices(cls, v):
        if v is not None and not 1 <= v <= MAX_N:
            raise refuse(f"n must be between 1 and {MAX_N}, got {v}", "n")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_in_range(cls, v):
        for key, value in (v or {}).items():
            if not -100 <= value <= 100:
                raise refuse(
                    f"logit_bias: the bias of token {key} must be between -100 and 100, got {value}", "logit_bias"
                )
        return v

    @field_validator("k")
    @classmethod
    def _k_not_negative(cls, v):
        if isinstance(v, int) and v < 0:
            raise ValueError("k (draft length) must be >= 0 (0 = plain decoding)")
        if isinstance(v, str) and v != "auto":
            if not v.strip().isdigit():
                raise refuse(f'k = {v!r} is not supported: send an integer >= 0 or "auto"', "k")
            return int(v)
        return v

    @model_validator(mode="after")
    def _read_grammar(self):
        self._grammar = _grammar_of(self)
        return self


class CompletionRequest(Params):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: StrictBool = False
    suffix: str | None = None
    best_of: StrictInt | None = None

    @model_validator(mode="after")
    def _supported(self):
        if self.echo or self.suffix or (self.best_of or 1) > 1:
            field_ = "echo" if self.echo else "suffix" if self.suffix else "best_of"
            raise refuse(
                f"{field_} is not supported by this server; leave the field out", field_, "unsupported_parameter"
            )
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) and len(prompt) != 1:
            raise refuse(
                f"a batch of {len(prompt)} prompts is not supported: send one prompt per request",
                "prompt",
                "unsupported_parameter",
            )
        if self.top_logprobs is not None:
            raise refuse("top_logprobs is a chat field; a completion request sends logprobs = 0..20", "top_logprobs")
        if isinstance(self.logprobs, bool):
            raise refuse("logprobs must be an integer 0..20 in a completion request", "logprobs")
        _check_top_logprobs("logprobs", self.logprobs)
        return self

    def top_logprobs_wanted(self) -> int | None:
        """How many top logprobs to report beside each token's (None: no logprobs)."""
        return self.logprobs

    def single_prompt(self) -> str | list[int]:
        """The prompt: a string or token ids (a batch of one unwrapped)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            return prompt[0]
        return prompt


class _ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class _Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[_ContentPart] | None = None

    @model_validator(mode="after")
    def _content_unless_assistant(self):
        if self.content is None and self.role != "assistant":  # an assistant's may be null (tool calls)
            raise ValueError(f"a {self.role} message needs content (a string or a list of text parts)")
        return self


class ChatRequest(Params):
    messages: list[_Message] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=0)
    tools: Any = None

    @model_validator(mode="after")
    def _supported(self):
        if self.tools:
            raise refuse(
                "tools are not supported by this server; leave the field out", "tools", "unsupported_parameter"
            )
        for i, m in enumerate(self.messages):
            other = [p.type for p in m.content if p.type != "text"] if isinstance(m.content, list) else []
            if other:
                raise refuse(
                    f"messages.{i}.content: only text parts are supported, got {other[0]!r}",
                    f"messages.{i}.content",
                    "unsupported_parameter",
                )
        if self.top_logprobs is not None and not self.logprobs:
            raise refuse("top_logprobs needs logprobs = true", "top_logprobs")
        if self.logprobs not in (None, False, True):
            raise refuse(
                "logprobs must be true or false in a chat request (top_logprobs: how many alternatives)", "logprobs"
            )
        _check_top_logprobs("top_logprobs", (self.top_logprobs or 0) if self.logprobs else None)
        return self

    def top_logprobs_wanted(self) -> int | None:
        """How many top logprobs to report beside each token's (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def texts(self) -> list[dict[str, str]]:
        """The messages as {"role", "content"} with each content one string (text parts joined)."""
        return [
            {
                "role": m.role,
                "content": "".join(p.text or "" for p in m.content) if isinstance(m.content, list) else m.content or "",
            }
            for m in self.messages
        ]


def _check_top_logprobs(name: str, value: int | None) -> None:
    if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
        raise refuse(f"{name} must be between 0 and {MAX_TOP_LOGPROBS}, got {value}", name)


_ONE_OF = {  # fields that take one of several types, and how to say so
    "prompt": "a string or a list of token ids (or a list holding one of these)",
    "stop": "a string or a list of strings",
    "k": 'an integer >= 0 (0 = plain decoding) or "auto"',
    "messages.*.content": 'a string or a list of text parts ({"type": "text", "text": ...})',
}
BODIES: dict[str, type[Params]] = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatRequest}
SEND_JSON = "send a JSON object with Content-Type: application/json"


def invalid(errors: Iterable[Mapping[str, Any]], cls: type[BaseModel], content_type: str | None) -> ApiError:
    """The ApiError 400 for a request body FastAPI could not validate as `cls` (errors: its
    RequestValidationError's, each located under "body"): a body that is not JSON, not an object,
    or sent without a JSON Content-Type (code invalid_json); a field the server does not honour
    (unsupported_parameter, naming it); else every bad field with what it expects
    (invalid_parameter, param: the first one). A validator's refusal (see refuse) is answered as it
    is, once no field has a wrong type or range."""
    errors = [{**err, "loc": tuple(err["loc"])[1:]} for err in errors]  # drop "body"
    refused = [err for err in errors if err["type"] == REFUSED]
    if refused and len(refused) == len(errors):  # a validator's own refusal, once the types are right
        ctx = refused[0]["ctx"]
        return ApiError(400, ctx["message"], code=ctx["code"], param=ctx["param"])
    errors = [err for err in errors if err["type"] != REFUSED]
    for err in errors:
        if err["type"] == "json_invalid":
            where = f" at character {err['loc'][0]}" if err["loc"] else ""
            reason = err.get("ctx", {}).get("error", err["msg"])
            return ApiError(
                400, f"the request body is not valid JSON ({reason}{where}); {SEND_JSON}", code="invalid_json"
            )
        if not err["loc"]:  # the body as a whole: none, not an object, or not read as JSON
            body = err.get("input")
            if err["type"] == "missing":
                message = f"the request body is empty; {SEND_JSON}"
            elif isinstance(body, bytes):  # FastAPI reads a body as JSON only with a JSON Content-Type
                sent_as = f"with Content-Type: {content_type}" if content_type else "without a Content-Type"
                message = f"the request body came {sent_as}, not JSON; {SEND_JSON}"
            else:
                message = f"the request body must be a JSON object, got {type(body).__name__}; {SEND_JSON}"
            return ApiError(400, message, code="invalid_json")
    extra = [err["loc"][0] for err in errors if err["type"] == "extra_forbidden" and len(err["loc"]) == 1]
    if extra:
        honoured = ", ".join(cls.model_fields)
        return ApiError(
            400,
            f"{extra[0]!r} is not a field this server honours; leave it out (the fields it reads: {honoured})",
            code="unsupported_parameter",
            param=str(extra[0]),
        )
    parts: dict[str, str] = {}
    for err in errors:
        loc = err["loc"]
        got = "" if err["type"] == "missing" else f" (got {json.dumps(err.get('input'), default=str)[:80]})"
        pattern = ".".join("*" if isinstance(x, int) else str(x) for x in loc[:-1])
        if pattern in _ONE_OF and isinstance(loc[-1], str):  # a union's branch failed: say what is expected
            where = ".".join(str(x) for x in loc[:-1])
            parts.setdefault(where, f"{where}: expected {_ONE_OF[pattern]}{got}")
        elif err["type"] == "extra_forbidden":  # a key inside an object (response_format, ...)
            where = ".".join(str(x) for x in loc)
            parts.setdefault(where, f"{where}: not a key this server reads; leave it out")
        else:
            where = ".".join(str(x) for x in loc)
            parts.setdefault(where, f"{where}: {err['msg']}{got}")
    param = next(iter(parts)).split(".")[0] if parts else None
    return ApiError(400, "invalid request: " + "; ".join(parts.values()), code="invalid_parameter", param=param)


STRUCTURED_FIELDS = (
    "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar"
)  # fmt: skip
_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")  # structured_outputs' keys


def structured_fields(req: Params) -> list[str]:
    """The fields of a request that ask for structured output (response_format "text" asks for none)."""
    return [
        name
        for name in STRUCTURED_FIELDS
        if getattr(req, name) is not None and not (name == "response_format" and req.response_format.type == "text")
    ]


def _grammar_of(req: Params) -> tuple[Grammar | None, str | None]:
    """The grammar a request's output must follow, and the field that asked for it (None, None:
    free text). Raises a refusal for two such fields at once (response_format {"type": "text"} asks
    for none), structured_outputs without exactly one kind, or a grammar that is malformed on its
    face (llguidance's compile is Server.check_grammar's)."""
    given = structured_fields(req)
    if len(given) > 1:
        raise refuse(f"{' and '.join(given)} each ask for structured output: send only one of them", given[0])
    if not given:
        return None, None
    field_ = given[0]
    try:
        if field_ == "response_format":
            fmt = req.response_format
            json_object = fmt.type == "json_object"
            grammar = Grammar.json_object() if json_object else Grammar.json_schema(fmt.json_schema.schema_)
        elif field_ == "structured_outputs":
            so = req.structured_outputs
            values = {"json": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar}
            values["json_object"] = so.json_object or None  # false asks for nothing
            kinds = [kind for kind in _STRUCTURED_KINDS if values[kind] is not None]
            if len(kinds) != 1:
                raise refuse(
                    f"structured_outputs takes exactly one of {', '.join(_STRUCTURED_KINDS)} (json_object: true); "
                    f"got {', '.join(kinds) if kinds else 'none'}",
                    field_,
                )
            kind, value = kinds[0], values[kinds[0]]
            grammar = {
                "json": Grammar.json_schema, "regex": Grammar.regex, "choice": Grammar.choice, "grammar": Grammar.lark,
                "json_object": lambda _: Grammar.json_object(),
            }[kind](value)  # fmt: skip
        elif field_ == "guided_json":
            grammar = Grammar.json_schema(req.guided_json)
        elif field_ == "guided_regex":
            grammar = Grammar.regex(req.guided_regex)
        elif field_ == "guided_choice":
            grammar = Grammar.choice(req.guided_choice)
        else:
            grammar = Grammar.lark(req.guided_grammar)
    except GrammarError as e:
        raise refuse(f"{field_}: {e}", field_) from None
    return grammar, field_
