"""A controller app run in this process (lifespan and background loops included), for tests
that need its HTTP API but not a separate process."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from starlette.exceptions import StarletteDeprecationWarning

from gpupool.controller.app import create_app
from gpupool.controller.settings import ControllerSettings
from tests.conftest import ADMIN_TOKEN, AUTH

with warnings.catch_warnings():
    # Starlette asks for httpx2 in a future version; the client works the same today.
    warnings.simplefilter("ignore", StarletteDeprecationWarning)
    from fastapi.testclient import TestClient

API = "/api/v1"


@contextmanager
def controller(tmp_path: Path, **settings: object) -> Iterator[TestClient]:
    settings.setdefault("admin_token", ADMIN_TOKEN)
    app = create_app(ControllerSettings(data_dir=tmp_path, **settings))  # type: ignore[arg-type]
    with TestClient(app, headers=AUTH) as client:
        yield client


def register(client: TestClient, name: str = "node-a", gpus: int = 2) -> list[str]:
    body = {
        "name": name,
        "gpus": [
            {"uuid": f"GPU-{name}-{i}", "index": i, "model": "H100", "memory_mib": 81920}
            for i in range(gpus)
        ],
    }
    response = client.post(f"{API}/nodes", json=body)
    assert response.status_code == 201, response.text
    return [g["uuid"] for g in body["gpus"]]  # type: ignore[index]
