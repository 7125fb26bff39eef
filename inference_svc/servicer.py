"""gRPC servicer of the inference service: proto → domain call → proto, nothing else."""

from __future__ import annotations

import contextlib
import math
import uuid

from adapter_store.errors import InvalidArgument
from adapter_store.rpc.handlers import rpc_method
from inference_svc.adapters.caller import Caller
from inference_svc.engine.engine import LoadedAdapterInfo
from inference_svc.engine.sampling import SamplingParams
from inference_svc.engine.sequence import FinishReason, GenerationParams, SequenceOutput
from inference_svc.service import GenerateInput, InferenceService
from protos import inference_pb2 as pb
from protos import inference_pb2_grpc

SERVICE_NAME = "loraserve.v1.Inference"
DEFAULT_MAX_NEW_TOKENS = 16

_FINISH = {
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.EOS: pb.FINISH_REASON_EOS,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
    FinishReason.ERROR: pb.FINISH_REASON_ERROR,
}
_TIER = {"gpu": pb.TIER_GPU, "host": pb.TIER_HOST, "loading": pb.TIER_LOADING}


def generation_params(request: pb.GenerateRequest) -> GenerationParams:
    """The proto's sampling fields ("0 means default/off") as validated domain params."""
    s = request.sampling
    if s.max_new_tokens < 0:
        raise InvalidArgument(f"sampling.max_new_tokens must be >= 0, got {s.max_new_tokens}")
    if not (math.isfinite(s.temperature) and s.temperature >= 0):
        raise InvalidArgument(f"sampling.temperature must be >= 0, got {s.temperature}")
    if not (math.isfinite(s.top_p) and 0 <= s.top_p <= 1):
        raise InvalidArgument(f"sampling.top_p must be in (0, 1] (0: off), got {s.top_p}")
    if s.top_k < 0:
        raise InvalidArgument(f"sampling.top_k must be >= 0 (0: off), got {s.top_k}")
    if any(not stop for stop in s.stop):
        raise InvalidArgument("sampling.stop: stop strings must not be empty")
    return GenerationParams(
        max_new_tokens=s.max_new_tokens or DEFAULT_MAX_NEW_TOKENS,
        sampling=SamplingParams(
            temperature=s.temperature,
            top_k=s.top_k,
            top_p=s.top_p or 1.0,
            seed=s.seed if s.HasField("seed") else None,
        ),
        stop=tuple(s.stop),
        stop_token_ids=tuple(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        logprobs=request.logprobs,
        prompt_logprobs=request.prompt_logprobs,
    )


def loaded_adapter_to_proto(info: LoadedAdapterInfo) -> pb.LoadedAdapter:
    return pb.LoadedAdapter(
        name=info.name,
        version=info.version,
        tier=_TIER[info.tier],
        slot=info.slot,
        rank=info.rank,
        pinned=info.pinned,
        last_used=info.last_used,
        size_bytes=info.size_bytes,
        active_requests=info.active_requests,
    )


def _response(output: SequenceOutput) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        token_ids=output.token_ids,
        text=output.text,
        logprobs=output.logprobs,
        prompt_logprobs=output.prompt_logprobs or (),
        finish_reason=_FINISH[output.finish_reason] if output.finish_reason else 0,
    )


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    def __init__(self, service: InferenceService, max_lora_rank: int) -> None:
        self._service = service
        self._max_lora_rank = max_lora_rank

    @rpc_method
    async def Generate(self, request, context):  # noqa: N802 - gRPC name
        prepared = await self._service.prepare(
            GenerateInput(
                request_id=request.request_id or uuid.uuid4().hex,
                adapter_ref=request.adapter,
                prompt=request.prompt,
                prompt_token_ids=list(request.prompt_token_ids),
                params=generation_params(request),
                caller=Caller.from_metadata(context.invocation_metadata()),
            )
        )
        first = True
        # aclosing: a client that goes away mid-stream closes the engine request at once.
        async with contextlib.aclosing(self._service.stream(prepared)) as outputs:
            async for output in outputs:
                response = _response(output)
                if first:
                    response.prompt_tokens = len(prepared.prompt_token_ids)
                    response.adapter_version = prepared.adapter_version
                    first = False
                yield response

    @rpc_method
    async def LoadAdapter(self, request, context):  # noqa: N802
        if not request.adapter:
            raise InvalidArgument("adapter: give the adapter ref to load (name or name@N)")
        caller = Caller.from_metadata(context.invocation_metadata())
        info, load_ms = await self._service.load_adapter(request.adapter, request.pin, caller)
        return pb.LoadAdapterResponse(adapter=loaded_adapter_to_proto(info), load_ms=load_ms)

    @rpc_method
    async def UnloadAdapter(self, request, context):  # noqa: N802
        if not request.adapter:
            raise InvalidArgument("adapter: give the adapter ref to unload (name or name@N)")
        caller = Caller.from_metadata(context.invocation_metadata())
        unloaded = await self._service.unload_adapter(request.adapter, caller)
        return pb.UnloadAdapterResponse(unloaded=unloaded)

    @rpc_method
    async def ListLoadedAdapters(self, request, context):  # noqa: N802
        caller = Caller.from_metadata(context.invocation_metadata())
        adapters, stats = await self._service.list_loaded(caller)
        return pb.ListLoadedAdaptersResponse(
            adapters=[loaded_adapter_to_proto(a) for a in adapters],
            slots_total=stats.slots_total,
            slots_used=stats.slots_used,
            max_lora_rank=self._max_lora_rank,
        )
