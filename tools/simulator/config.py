"""Settings of one simulated vLLM server: its served model and its latency model.

The latency model is deliberately small. One engine step costs
    step_base_ms + step_ms_per_seq * running_sequences
plus, when the step admits new requests, prefill_base_ms + prefill_ms_per_token * uncached prompt tokens.
Every running sequence gets one token per step, so aggregate throughput rises with the batch and flattens,
and once max_num_seqs is reached new requests wait in a FIFO queue and time to first token explodes:
the knee a real vLLM shows.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class SimConfig(BaseModel):
    """Everything that shapes one simulator; defaults are fast enough for a demo and for tests."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field("sim", min_length=1, description="served model name (vLLM's --served-model-name)")
    max_model_len: int = Field(2048, ge=16, description="prompt + output tokens allowed per request")
    max_num_seqs: int = Field(32, ge=1, description="batch cap; beyond it requests wait in the queue")
    step_base_ms: float = Field(4.0, ge=0, description="fixed cost of one decode step")
    step_ms_per_seq: float = Field(0.1, ge=0, description="extra step cost per running sequence")
    prefill_base_ms: float = Field(1.0, ge=0, description="extra cost of a step that runs any prefill")
    prefill_ms_per_token: float = Field(0.01, ge=0, description="prefill cost per uncached prompt token")
    default_max_tokens: int = Field(256, ge=1, description="chat output cap when the request sets none")
    natural_output_tokens: int = Field(48, ge=1, description="where the model 'emits EOS' unless ignore_eos")
    kv_cache_tokens: int = Field(65536, ge=16, description="simulated KV-cache capacity in tokens")
    block_size: int = Field(16, ge=1, description="KV block size; prefix caching works in whole blocks")
    enable_prefix_caching: bool = True
    seed: int = 0
    embedding_dim: int = Field(384, ge=1)
    # like vLLM's --enable-auto-tool-choice: a request with `tools` is answered with a call of its first tool
    # (or the one tool_choice names), its arguments made from the tool's parameters schema
    tool_calling: bool = False
    # the share of structured answers (response_format JSON, tool-call arguments) sent broken, evenly spread
    # (tools/simulator/structured.py): a model whose quantisation breaks JSON, for the variant guard
    corrupt_fraction: float = Field(0.0, ge=0, le=1)
    # a response made with `background` and `stream` fails after this many output text events: an `error` frame,
    # as vLLM sends when its engine fails, and then, as vLLM, its stream (made or replayed) stays open and
    # silent (vLLM ends one only after `response.completed`). None: never
    fail_background_after: int | None = Field(None, ge=0)
    # vLLM's --enable-lora with run-time updating (tools/simulator/lora.py); a load takes lora_load_ms
    enable_lora: bool = False
    # each generated word a function of the whole text before it (prompt and output so far), as a model at
    # temperature 0: a request whose prompt ends with part of an answer continues that answer word for word
    # (a stream that goes on from another replica). Off: the words follow one seed per prompt
    context_seeded: bool = False
    lora_load_ms: float = Field(0.0, ge=0)
    # vLLM's --api-key (or VLLM_API_KEY): every /v1 call must carry it as a Bearer token, else 401; None: open
    api_key: str | None = Field(None, min_length=1, repr=False)

    @model_validator(mode="after")
    def _cache_holds_one_request(self) -> SimConfig:
        if self.kv_cache_tokens < self.max_model_len:
            raise ValueError("kv_cache_tokens must hold at least one max_model_len request")
        return self

    @classmethod
    def reference_gpu(cls, **overrides: object) -> SimConfig:
        """The talk's BF16 Qwen3-4B on one small GPU (256 prompt / 128 output tokens, closed loop).

        Fitted to concurrency 1 -> ~37 tok/s, TTFT ~61 ms and concurrency 32 -> ~700 tok/s, TTFT ~280 ms.
        The knee comes from max_num_seqs=32, so at 64 concurrent the throughput stays flat near 700 tok/s
        (the talk saw ~800) and TTFT climbs to seconds, because half the requests queue for a whole
        generation (the talk saw 1.3 s): the shape is right, the 64-concurrent TTFT is pessimistic.
        """
        values = dict(
            model="qwen3-4b-sim",
            max_model_len=8192,
            max_num_seqs=32,
            step_base_ms=25.9,
            step_ms_per_seq=0.535,
            prefill_base_ms=28.2,
            prefill_ms_per_token=0.0251,
            kv_cache_tokens=65536,
        )
        values.update(overrides)
        return cls(**values)
