from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class SparseFeatures(_message.Message):
    __slots__ = ("keys", "lengths", "values", "shared_keys", "shared_lengths", "shared_values")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    SHARED_KEYS_FIELD_NUMBER: _ClassVar[int]
    SHARED_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    SHARED_VALUES_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    lengths: Tensor
    values: Tensor
    shared_keys: _containers.RepeatedScalarFieldContainer[str]
    shared_lengths: Tensor
    shared_values: Tensor
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., lengths: _Optional[_Union[Tensor, _Mapping]] = ..., values: _Optional[_Union[Tensor, _Mapping]] = ..., shared_keys: _Optional[_Iterable[str]] = ..., shared_lengths: _Optional[_Union[Tensor, _Mapping]] = ..., shared_values: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class PredictRequest(_message.Message):
    __slots__ = ("model_name", "model_version", "dense", "sparse", "model_version_label")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    DENSE_FIELD_NUMBER: _ClassVar[int]
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_LABEL_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    model_version: int
    dense: Tensor
    sparse: SparseFeatures
    model_version_label: str
    def __init__(self, model_name: _Optional[str] = ..., model_version: _Optional[int] = ..., dense: _Optional[_Union[Tensor, _Mapping]] = ..., sparse: _Optional[_Union[SparseFeatures, _Mapping]] = ..., model_version_label: _Optional[str] = ...) -> None: ...

class PredictResponse(_message.Message):
    __slots__ = ("ctr", "model_name", "model_version")
    CTR_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ctr: Tensor
    model_name: str
    model_version: int
    def __init__(self, ctr: _Optional[_Union[Tensor, _Mapping]] = ..., model_name: _Optional[str] = ..., model_version: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("model_name", "model_version", "sparse", "model_version_label")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_LABEL_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    model_version: int
    sparse: SparseFeatures
    model_version_label: str
    def __init__(self, model_name: _Optional[str] = ..., model_version: _Optional[int] = ..., sparse: _Optional[_Union[SparseFeatures, _Mapping]] = ..., model_version_label: _Optional[str] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("keys", "dims", "pooled", "model_name", "model_version")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    DIMS_FIELD_NUMBER: _ClassVar[int]
    POOLED_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    dims: _containers.RepeatedScalarFieldContainer[int]
    pooled: Tensor
    model_name: str
    model_version: int
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., dims: _Optional[_Iterable[int]] = ..., pooled: _Optional[_Union[Tensor, _Mapping]] = ..., model_name: _Optional[str] = ..., model_version: _Optional[int] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ("model_name", "model_version", "model_version_label")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_LABEL_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    model_version: int
    model_version_label: str
    def __init__(self, model_name: _Optional[str] = ..., model_version: _Optional[int] = ..., model_version_label: _Optional[str] = ...) -> None: ...

class FeatureInfo(_message.Message):
    __slots__ = ("name", "table", "rows", "dim", "pooling", "weight_dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    table: str
    rows: int
    dim: int
    pooling: str
    weight_dtype: str
    def __init__(self, name: _Optional[str] = ..., table: _Optional[str] = ..., rows: _Optional[int] = ..., dim: _Optional[int] = ..., pooling: _Optional[str] = ..., weight_dtype: _Optional[str] = ...) -> None: ...

class ModelVersionInfo(_message.Message):
    __slots__ = ("version", "state", "device", "model_sha256")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MODEL_SHA256_FIELD_NUMBER: _ClassVar[int]
    version: int
    state: str
    device: str
    model_sha256: str
    def __init__(self, version: _Optional[int] = ..., state: _Optional[str] = ..., device: _Optional[str] = ..., model_sha256: _Optional[str] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "features", "dense_features", "versions", "max_batch_size", "manifest_json", "version_labels", "config_json")
    class VersionLabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    DENSE_FEATURES_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    VERSION_LABELS_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    features: _containers.RepeatedCompositeFieldContainer[FeatureInfo]
    dense_features: int
    versions: _containers.RepeatedCompositeFieldContainer[ModelVersionInfo]
    max_batch_size: int
    manifest_json: str
    version_labels: _containers.ScalarMap[str, int]
    config_json: str
    def __init__(self, name: _Optional[str] = ..., features: _Optional[_Iterable[_Union[FeatureInfo, _Mapping]]] = ..., dense_features: _Optional[int] = ..., versions: _Optional[_Iterable[_Union[ModelVersionInfo, _Mapping]]] = ..., max_batch_size: _Optional[int] = ..., manifest_json: _Optional[str] = ..., version_labels: _Optional[_Mapping[str, int]] = ..., config_json: _Optional[str] = ...) -> None: ...

class GetModelInfoResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...
