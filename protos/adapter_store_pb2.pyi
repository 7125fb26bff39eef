from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class BaseModel(_message.Message):
    __slots__ = ("name", "config_json", "architecture", "lora_modules", "created_at", "config_sha256")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    LORA_MODULES_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    CONFIG_SHA256_FIELD_NUMBER: _ClassVar[int]
    name: str
    config_json: str
    architecture: str
    lora_modules: _containers.RepeatedScalarFieldContainer[str]
    created_at: str
    config_sha256: str
    def __init__(self, name: _Optional[str] = ..., config_json: _Optional[str] = ..., architecture: _Optional[str] = ..., lora_modules: _Optional[_Iterable[str]] = ..., created_at: _Optional[str] = ..., config_sha256: _Optional[str] = ...) -> None: ...

class RegisterBaseModelRequest(_message.Message):
    __slots__ = ("name", "config_json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    config_json: str
    def __init__(self, name: _Optional[str] = ..., config_json: _Optional[str] = ...) -> None: ...

class GetBaseModelRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class ListBaseModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListBaseModelsResponse(_message.Message):
    __slots__ = ("base_models",)
    BASE_MODELS_FIELD_NUMBER: _ClassVar[int]
    base_models: _containers.RepeatedCompositeFieldContainer[BaseModel]
    def __init__(self, base_models: _Optional[_Iterable[_Union[BaseModel, _Mapping]]] = ...) -> None: ...

class UploadHeader(_message.Message):
    __slots__ = ("name", "base_model", "description", "labels", "dtype")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    base_model: str
    description: str
    labels: _containers.ScalarMap[str, str]
    dtype: str
    def __init__(self, name: _Optional[str] = ..., base_model: _Optional[str] = ..., description: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., dtype: _Optional[str] = ...) -> None: ...

class FileChunk(_message.Message):
    __slots__ = ("filename", "data")
    FILENAME_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    filename: str
    data: bytes
    def __init__(self, filename: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class UploadAdapterRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: UploadHeader
    chunk: FileChunk
    def __init__(self, header: _Optional[_Union[UploadHeader, _Mapping]] = ..., chunk: _Optional[_Union[FileChunk, _Mapping]] = ...) -> None: ...

class ModuleRank(_message.Message):
    __slots__ = ("module", "rank")
    MODULE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    module: str
    rank: int
    def __init__(self, module: _Optional[str] = ..., rank: _Optional[int] = ...) -> None: ...

class Adapter(_message.Message):
    __slots__ = ("name", "version", "base_model", "rank", "target_modules", "sha256", "size_bytes", "created_at", "description", "labels", "tenant", "dtype", "moe_layout", "module_ranks", "storage_prefix", "format_version", "parts_sha256")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MOE_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    MODULE_RANKS_FIELD_NUMBER: _ClassVar[int]
    STORAGE_PREFIX_FIELD_NUMBER: _ClassVar[int]
    FORMAT_VERSION_FIELD_NUMBER: _ClassVar[int]
    PARTS_SHA256_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    base_model: str
    rank: int
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    sha256: str
    size_bytes: int
    created_at: str
    description: str
    labels: _containers.ScalarMap[str, str]
    tenant: str
    dtype: str
    moe_layout: str
    module_ranks: _containers.RepeatedCompositeFieldContainer[ModuleRank]
    storage_prefix: str
    format_version: int
    parts_sha256: str
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ..., base_model: _Optional[str] = ..., rank: _Optional[int] = ..., target_modules: _Optional[_Iterable[str]] = ..., sha256: _Optional[str] = ..., size_bytes: _Optional[int] = ..., created_at: _Optional[str] = ..., description: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., tenant: _Optional[str] = ..., dtype: _Optional[str] = ..., moe_layout: _Optional[str] = ..., module_ranks: _Optional[_Iterable[_Union[ModuleRank, _Mapping]]] = ..., storage_prefix: _Optional[str] = ..., format_version: _Optional[int] = ..., parts_sha256: _Optional[str] = ...) -> None: ...

class GetAdapterRequest(_message.Message):
    __slots__ = ("ref",)
    REF_FIELD_NUMBER: _ClassVar[int]
    ref: str
    def __init__(self, ref: _Optional[str] = ...) -> None: ...

class ListAdaptersRequest(_message.Message):
    __slots__ = ("page_size", "page_token", "base_model", "label", "all_versions")
    class LabelEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    ALL_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    base_model: str
    label: _containers.ScalarMap[str, str]
    all_versions: bool
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., base_model: _Optional[str] = ..., label: _Optional[_Mapping[str, str]] = ..., all_versions: _Optional[bool] = ...) -> None: ...

class ListAdaptersResponse(_message.Message):
    __slots__ = ("adapters", "next_page_token")
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[Adapter]
    next_page_token: str
    def __init__(self, adapters: _Optional[_Iterable[_Union[Adapter, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class DeleteAdapterRequest(_message.Message):
    __slots__ = ("ref",)
    REF_FIELD_NUMBER: _ClassVar[int]
    ref: str
    def __init__(self, ref: _Optional[str] = ...) -> None: ...

class DeleteAdapterResponse(_message.Message):
    __slots__ = ("versions",)
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    versions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, versions: _Optional[_Iterable[int]] = ...) -> None: ...

class FetchAdapterRequest(_message.Message):
    __slots__ = ("ref", "chunk_size")
    REF_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    ref: str
    chunk_size: int
    def __init__(self, ref: _Optional[str] = ..., chunk_size: _Optional[int] = ...) -> None: ...

class AdapterChunk(_message.Message):
    __slots__ = ("adapter", "manifest_json", "data", "offset", "total_size")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SIZE_FIELD_NUMBER: _ClassVar[int]
    adapter: Adapter
    manifest_json: bytes
    data: bytes
    offset: int
    total_size: int
    def __init__(self, adapter: _Optional[_Union[Adapter, _Mapping]] = ..., manifest_json: _Optional[bytes] = ..., data: _Optional[bytes] = ..., offset: _Optional[int] = ..., total_size: _Optional[int] = ...) -> None: ...

class WhoAmIRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WhoAmIResponse(_message.Message):
    __slots__ = ("tenant",)
    TENANT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    def __init__(self, tenant: _Optional[str] = ...) -> None: ...
