"""A Python client for `rlhf-rollout serve`: the VLLMEngine methods over gRPC.

    client = RolloutClient("127.0.0.1:50052")
    client = RolloutClient("10.0.0.5:50052", token=token, tls_ca="ca.pem")   # a secured server
    samples = client.generate(["2 + 2 ="], SamplingSettings(n=4, max_tokens=32))
    client.update_weights()          # after init_weight_sync, while the trainer sends

Errors come back as `grpc.RpcError` with the server's status code and message
(INVALID_ARGUMENT for bad prompts or settings).
"""

import os
from collections.abc import Iterator, Sequence

import grpc

from ferrule_grpc_auth import bearer, channel_credentials
from ferrule_rollout import rollout_pb2 as pb
from ferrule_rollout import rollout_pb2_grpc
from ferrule_rollout.samples import Prompt, Sample, SamplingSettings, VersionSpan
from ferrule_rollout.security import TOKEN_ENV
from ferrule_rollout.server import MAX_MESSAGE_BYTES

STATUS_NAMES = {v: k for k, v in pb.HealthResponse.Status.items()}


def settings_to_proto(settings: SamplingSettings) -> pb.SamplingSettings:
    message = pb.SamplingSettings(
        n=settings.n,
        temperature=settings.temperature,
        top_p=settings.top_p,
        top_k=settings.top_k,
        max_tokens=settings.max_tokens,
        stop=list(settings.stop),
        ignore_eos=settings.ignore_eos,
    )
    if settings.seed is not None:
        message.seed = settings.seed
    return message


def prompt_to_proto(prompt: Prompt) -> pb.Prompt:
    return pb.Prompt(text=prompt) if isinstance(prompt, str) else pb.Prompt(token_ids=prompt)


def sample_from_proto(message: pb.Sample) -> Sample:
    return Sample(
        prompt_index=message.prompt_index,
        sample_index=message.sample_index,
        prompt_token_ids=list(message.prompt_token_ids),
        token_ids=list(message.token_ids),
        logprobs=list(message.logprobs),
        finish_reason=message.finish_reason,
        version=message.version,
        text=message.text,
        versions=[VersionSpan(s.version, s.start, s.end) for s in message.versions],
    )


class RolloutClient:
    """One channel to one rollout server. `timeout` (seconds) is each call's deadline.

    token: sent as `authorization: Bearer <token>` on every call; default $FERRULE_ROLLOUT_TOKEN.
    tls_ca, tls_cert, tls_key: TLS (on when any is given); `tls_ca` verifies the server
        (default: the system's roots), `tls_cert` / `tls_key` are for mutual TLS.
    tls_server_name: the name the server's certificate carries, when not the address's host.
    """

    def __init__(
        self,
        address: str,
        timeout: float | None = None,
        *,
        token: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        tls_server_name: str | None = None,
    ):
        options = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ]
        if tls_server_name:
            options.append(("grpc.ssl_target_name_override", tls_server_name))
        if any((tls_ca, tls_cert, tls_key)):
            credentials = channel_credentials(tls_ca, tls_cert, tls_key)
            self.channel = grpc.secure_channel(address, credentials, options)
        else:
            self.channel = grpc.insecure_channel(address, options)
        self.stub = rollout_pb2_grpc.RolloutServiceStub(self.channel)
        self.timeout = timeout
        self._metadata = bearer(token or os.environ.get(TOKEN_ENV))

    def _request(self, prompts, settings) -> pb.GenerateRequest:
        return pb.GenerateRequest(
            prompts=[prompt_to_proto(p) for p in prompts],
            sampling=settings_to_proto(settings or SamplingSettings()),
        )

    def generate(
        self, prompts: Sequence[Prompt], settings: SamplingSettings | None = None
    ) -> list[Sample]:
        response = self.stub.Generate(
            self._request(prompts, settings), timeout=self.timeout, metadata=self._metadata
        )
        return [sample_from_proto(s) for s in response.samples]

    def generate_stream(
        self, prompts: Sequence[Prompt], settings: SamplingSettings | None = None
    ) -> Iterator[Sample]:
        call = self.stub.GenerateStream(
            self._request(prompts, settings), timeout=self.timeout, metadata=self._metadata
        )
        try:
            for message in call:
                yield sample_from_proto(message)
        finally:
            call.cancel()  # a no-op after the last sample; aborts the rest if we stopped early

    def init_weight_sync(
        self,
        transport,
        host,
        port,
        rank,
        num_receivers,
        timeout: float = 300.0,
        secret: str | None = None,
    ) -> None:
        request = pb.InitWeightSyncRequest(
            transport=transport,
            host=host,
            port=port,
            rank=rank,
            num_receivers=num_receivers,
            timeout_s=timeout,
            secret=secret,
        )
        self.stub.InitWeightSync(request, timeout=self.timeout, metadata=self._metadata)

    def update_weights(self, mode: str = "wait", timeout: float | None = None) -> int:
        request = pb.UpdateWeightsRequest(pause_mode=mode)
        if timeout is not None:
            request.timeout_s = timeout
        return self.stub.UpdateWeights(
            request, timeout=self.timeout, metadata=self._metadata
        ).version

    def pause(self, mode: str = "wait", timeout: float | None = None) -> None:
        request = pb.PauseRequest(mode=mode)
        if timeout is not None:
            request.timeout_s = timeout
        self.stub.Pause(request, timeout=self.timeout, metadata=self._metadata)

    def resume(self) -> None:
        self.stub.Resume(pb.ResumeRequest(), timeout=self.timeout, metadata=self._metadata)

    def sleep(self, level: int = 1) -> None:
        self.stub.Sleep(pb.SleepRequest(level=level), timeout=self.timeout, metadata=self._metadata)

    def wake_up(self) -> None:
        self.stub.WakeUp(pb.WakeUpRequest(), timeout=self.timeout, metadata=self._metadata)

    def health(self) -> dict:
        response = self.stub.Health(
            pb.HealthRequest(), timeout=self.timeout, metadata=self._metadata
        )
        return {
            "status": STATUS_NAMES[response.status].lower(),
            "detail": response.detail,
            "version": response.version,
            "model": response.model,
            "running": response.running,
            "queued": response.queued,
        }

    def close(self) -> None:
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
