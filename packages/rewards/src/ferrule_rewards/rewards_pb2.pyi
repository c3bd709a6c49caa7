from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SampleStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SAMPLE_STATUS_OK: _ClassVar[SampleStatus]
    SAMPLE_STATUS_ERROR: _ClassVar[SampleStatus]
    SAMPLE_STATUS_TIMEOUT: _ClassVar[SampleStatus]
    SAMPLE_STATUS_INVALID_REWARD: _ClassVar[SampleStatus]
    SAMPLE_STATUS_INVALID_SAMPLE: _ClassVar[SampleStatus]
SAMPLE_STATUS_OK: SampleStatus
SAMPLE_STATUS_ERROR: SampleStatus
SAMPLE_STATUS_TIMEOUT: SampleStatus
SAMPLE_STATUS_INVALID_REWARD: SampleStatus
SAMPLE_STATUS_INVALID_SAMPLE: SampleStatus

class Sample(_message.Message):
    __slots__ = ("prompt", "response", "prompt_token_ids", "response_token_ids", "label", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    response: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    response_token_ids: _containers.RepeatedScalarFieldContainer[int]
    label: str
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, prompt: _Optional[str] = ..., response: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., response_token_ids: _Optional[_Iterable[int]] = ..., label: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("samples",)
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    samples: _containers.RepeatedCompositeFieldContainer[Sample]
    def __init__(self, samples: _Optional[_Iterable[_Union[Sample, _Mapping]]] = ...) -> None: ...

class Result(_message.Message):
    __slots__ = ("reward", "sub_scores", "status", "error")
    class SubScoresEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    REWARD_FIELD_NUMBER: _ClassVar[int]
    SUB_SCORES_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    reward: float
    sub_scores: _containers.ScalarMap[str, float]
    status: SampleStatus
    error: str
    def __init__(self, reward: _Optional[float] = ..., sub_scores: _Optional[_Mapping[str, float]] = ..., status: _Optional[_Union[SampleStatus, str]] = ..., error: _Optional[str] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[Result]
    def __init__(self, results: _Optional[_Iterable[_Union[Result, _Mapping]]] = ...) -> None: ...
