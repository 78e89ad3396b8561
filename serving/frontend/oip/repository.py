"""The OIP model repository extension (Triton's RepositoryIndex, RepositoryModelLoad,
RepositoryModelUnload): a translator onto the engines' model control (serving/engine/repository.py
``load_model``/``unload_model``, reached through ``EngineLink.control``). Mixed into the OIP servicer;
errors become status codes in serving/frontend/status.py ``grpc_errors``."""
from __future__ import annotations

from recserve.oip import grpc_predict_v2_pb2 as oip
from serving.errors import ControlOff, InvalidInput, ModelNotFound
from serving.frontend.status import Call, grpc_errors
from serving.frontend.validate import quoted

SERVICE = oip.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name


class RepositoryExtension:
    engine: object  # serving.frontend.link.EngineLink or Engines
    model_control: str  # ServerConfig.model_control

    @grpc_errors("RepositoryIndex", SERVICE)
    async def RepositoryIndex(self, body: bytes, context, call: Call) -> bytes:
        request = parse(oip.RepositoryIndexRequest, body)
        _one_repository(request.repository_name)
        index = oip.RepositoryIndexResponse.ModelIndex
        return oip.RepositoryIndexResponse(models=[
            index(name=name, version=version, state=state, reason=reason)
            for name, version, state, reason in self.engine.repository_index
            if not request.ready or state == "READY"]).SerializeToString()

    @grpc_errors("RepositoryModelLoad", SERVICE)
    async def RepositoryModelLoad(self, body: bytes, context, call: Call) -> bytes:
        await self._control("load", parse(oip.RepositoryModelLoadRequest, body), call)
        return oip.RepositoryModelLoadResponse().SerializeToString()

    @grpc_errors("RepositoryModelUnload", SERVICE)
    async def RepositoryModelUnload(self, body: bytes, context, call: Call) -> bytes:
        await self._control("unload", parse(oip.RepositoryModelUnloadRequest, body), call)
        return oip.RepositoryModelUnloadResponse().SerializeToString()

    async def _control(self, action: str, request, call: Call) -> None:
        if self.model_control != "explicit":
            raise ControlOff(f"model {action} is off: this server polls its repository; serve with "
                             "--model-control explicit to load and unload models by request")
        _one_repository(request.repository_name)
        if request.parameters:
            raise InvalidInput(f"parameters are not supported (got {sorted(request.parameters)})")
        name = request.model_name
        if name not in {entry[0] for entry in self.engine.repository_index}:
            raise ModelNotFound(f"no model {quoted(name)} in the repository")
        error = await self.engine.control(action, name)
        if error:
            raise InvalidInput(error)
        call.model = name


def _one_repository(name: str) -> None:
    if name:
        raise InvalidInput(f"repository_name {quoted(name)}: this server serves one repository; send \"\"")


def parse(message, body: bytes):
    try:
        return message.FromString(body)
    except Exception:  # noqa: BLE001 - protobuf's DecodeError and friends: the body is not the message
        raise InvalidInput(f"the request body is not a valid inference.{message.__name__}") from None
