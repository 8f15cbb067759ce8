"""Request parsing, prompt token estimates and vLLM-shaped errors for the simulator's OpenAI API.

Token estimate (there is no real tokenizer): text counts one token per 4 characters, rounded up. A chat is
first rendered with a ChatML-like template (`<|im_start|>role\\ncontent<|im_end|>\\n` per message, then
`<|im_start|>assistant\\n`), so each message costs about 7 tokens of template overhead, as real chat
templates do. Prompts given as token ids count one token per id. The estimate is deterministic, which is
all the gateway's token accounting and the prefix cache need.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ApiError(Exception):
    """An error that vLLM would answer with {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, type_: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")  # like vLLM: unknown fields are ignored

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1)
    ignore_eos: bool = False
    seed: int | None = None

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _Request:
        if self.stream_options is not None and not self.stream:
            raise ValueError("Stream options can only be defined when `stream=True`.")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    logprobs: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False

    @property
    def requested_max_tokens(self) -> int:
        return self.max_tokens or 16  # the OpenAI/vLLM default for completions


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: str = "float"
    dimensions: int | None = None


def parse(model_cls: type[BaseModel], body: Any) -> Any:
    """Validate a decoded JSON body; any problem is a 400 BadRequestError, as vLLM answers."""
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    try:
        return model_cls.model_validate(body)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}" for err in exc.errors()[:5])
        raise ApiError(400, f"{exc.error_count()} validation error(s): {problems}") from None


def tokenize(text: str) -> list[str]:
    """One token per 4 characters (the last may be shorter)."""
    return [text[i:i + 4] for i in range(0, len(text), 4)]


def _text_of(content: str | list[dict[str, Any]] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text":
            raise ApiError(400, f"Content part type {part.get('type')!r} is not supported: "
                                "this is a text-only model.", param="messages")
        parts.append(str(part.get("text", "")))
    return "\n".join(parts)


def render_chat(req: ChatRequest) -> str:
    """The prompt text a ChatML-style template would produce; with `continue_final_message` (vLLM's) the last
    message is left open, to be continued."""
    text = "".join(f"<|im_start|>{m.role}\n{_text_of(m.content)}<|im_end|>\n" for m in req.messages)
    if req.continue_final_message:
        if req.add_generation_prompt:
            raise ApiError(400, "Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        return text[:-len("<|im_end|>\n")]
    return text + ("<|im_start|>assistant\n" if req.add_generation_prompt else "")


def completion_prompt(req: CompletionRequest) -> Sequence[str | int]:
    """The single prompt of a completion request, as tokens (batched prompts are refused)."""
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ApiError(400, "The simulator serves one prompt per request; batched prompts are not "
                                "supported.", param="prompt")
        prompt = prompt[0]
    tokens = tokenize(prompt) if isinstance(prompt, str) else list(cast("list[int]", prompt))  # else: token ids
    return tokens or [""]  # an empty prompt still has a BOS token


def embedding_inputs(req: EmbeddingRequest) -> list[Sequence[str | int]]:
    inp = req.input
    items: list[str | list[int]]
    if isinstance(inp, str):
        items = [inp]
    elif inp and all(isinstance(x, int) for x in inp):
        items = [cast("list[int]", inp)]  # one prompt of token ids
    else:
        items = list(cast("list[str] | list[list[int]]", inp))  # prompts: texts or lists of ids
    if not items:
        raise ApiError(400, "Input cannot be empty.", param="input")
    return [(tokenize(x) if isinstance(x, str) else list(x)) or [""] for x in items]


def check_lengths(prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
    """vLLM's two length checks, with its wording."""
    if max_tokens is not None and max_tokens > max_model_len:
        raise ApiError(400, f"max_tokens={max_tokens} cannot be greater than max_model_len={max_model_len}. "
                            f"Please request fewer output tokens. (parameter=max_tokens, value={max_tokens})",
                       param="max_tokens")
    wanted = max_tokens or 0
    if prompt_tokens + wanted > max_model_len or prompt_tokens >= max_model_len:
        raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                            f"requested {wanted} output tokens and your prompt contains at least {prompt_tokens} "
                            f"input tokens, for a total of at least {prompt_tokens + wanted} tokens. Please "
                            f"reduce the length of the input prompt or the number of requested output tokens. "
                            f"(parameter=input_tokens, value={prompt_tokens})", param="input_tokens")


def refuse_unsupported(req: ChatRequest | CompletionRequest, tool_calling: bool = False) -> None:
    """Refuse what the simulator cannot honestly produce instead of faking it."""
    if req.n != 1:
        raise ApiError(400, "The simulator supports only n=1.", param="n")
    if req.logprobs or (isinstance(req, CompletionRequest) and req.echo):
        raise ApiError(400, "The simulator does not produce logprobs or echo.", param="logprobs")
    if isinstance(req, ChatRequest) and req.tools and req.tool_choice != "none" and not tool_calling:
        # A vLLM started without a tool parser answers the same; the simulator has no tool calling.
        raise ApiError(400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                       param="tool_choice")
