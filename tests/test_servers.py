"""The servers the tests start (tests/servers.py running): waited for while their process runs,
since `make test` starts them at nice 10 beside four starting twins (moto's server took over 30 s
to answer there, and its session fixture failed every test of two workers that used S3); one
that exits is reported with its status instead of being waited for."""

from __future__ import annotations

import sys

import pytest

from tests.servers import SERVER_START_SECONDS, free_port, running


def test_a_server_that_exits_before_it_answers_is_reported_with_its_status_and_log():
    port = free_port()
    with pytest.raises(TimeoutError) as refused:
        with running([sys.executable, "-c", "import sys; sys.stderr.write('no config'); sys.exit(3)"],
                     ready_url=f"http://127.0.0.1:{port}/"):
            pass
    assert "exited with 3" in str(refused.value) and "no config" in str(refused.value)


def test_a_server_that_answers_late_is_waited_for():
    """Its answer comes after a pause (a slow import); `running` yields once it answers."""
    port = free_port()
    server = (f"import time, http.server; time.sleep(2); "
              f"http.server.HTTPServer(('127.0.0.1', {port}), http.server.SimpleHTTPRequestHandler).serve_forever()")
    with running([sys.executable, "-c", server], ready_url=f"http://127.0.0.1:{port}/") as proc:
        assert proc.poll() is None
    assert SERVER_START_SECONDS >= 300  # what a loaded `make test` needs: see tests/servers.py
