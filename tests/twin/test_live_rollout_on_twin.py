"""Rollout and rollback on live traffic (#40): dev (SGLang) on the twin, a client sending requests
throughout along the live route (twin/live.py LiveClient: no Envoy proxy runs on the twin, so the
client splits by the HTTPRoute's weights as Envoy would and sends to the chosen track's router
Service endpoints), every track's router, engines and Mooncake master running as processes at
their pod addresses, and the canary gate reading the fleet's Prometheus: the one prometheus-operator
makes of the platform's Prometheus and the tracks' rendered monitors, at its pod address, scraping
the stand-ins there (twin/monitoring.py fleet_prometheus), never the healthy stand-in.

- `pdctl rollout --pulumi-stack dev` of the first revision takes 100%, and of a good second one
  moves the share it says: while the route is at 50/50 the client's answers come from both tracks,
  about half each, each answered by its own track's prefill; then all from r2.
- `pdctl rollback` moves the live share back to r1, as the client's answers show, with no failed
  request (both tracks stay up: the previous revision is a warm standby). Its time is printed.
- A bad revision, whose render names a slow build of the engine image (the fleet model gives that
  image's stand-ins a 3 s TTFT, above dev's 2 s SLO: twin/live.py), is stopped by the gate at
  its first stage on SGLang 0.5.23's own `sglang:time_to_first_token_seconds` histogram and
  reverted automatically: the client's share is back on r1.

The scenario (live_dev) is twin/live.py's, shared with scripts/bench_rollback.py --twin; what stands
in: see there (status of Envoy Gateway and Karpenter's AWS provider, the platform stack). Runs in the live-traffic group, with a twin of its own (scripts/run_tests.py LIVE_TRAFFIC_FILES).
"""

from __future__ import annotations

import sys
import time

import pytest

from tests.engine import require_engine
from tests.twin.conftest import FIGURES
from twin import live
from twin.live import SLOW_TTFT_MS, live_dev, retuned_router, slow_build, timed_rollback


def test_rollout_and_rollback_move_the_live_share_and_the_gate_stops_a_slow_build(twin, tmp_path):
    require_engine()
    began = time.monotonic()
    with live_dev(tmp_path) as env:
        first = env.rollout(env.base_spec, "100")
        assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
        assert env.store.traffic() == {1: 100}, env.store.state()

        good_started = time.monotonic()
        good = env.rollout(env.spec_file("good", retuned_router), "50,100")
        assert good.returncode == 0, good.stdout[-3000:] + good.stderr[-3000:]
        assert env.store.traffic() == {2: 100} and env.store.status(2) == "good", env.store.state()
        split = env.client.while_routed({1: 50, 2: 50})
        split_shares = live.shares(split)
        assert set(split_shares) == {1, 2} and 0.3 <= split_shares[2] <= 0.7, (len(split), split_shares)
        whole = env.client.while_routed({2: 100})
        assert whole and live.shares(whole) == {2: 1.0}, live.shares(whole)
        during = env.client.since(good_started)
        assert [a for a in during if a.ok and a.answered_by != a.sent_to] == [], "a track's router used another's prefill"
        assert [a for a in during if not a.ok] == [], [a.detail for a in during if not a.ok][:5]

        command, back, answers = timed_rollback(env, 1)
        failed = [a for a in answers if not a.ok]
        assert failed == [], [a.detail for a in failed][:5]
        assert env.store.traffic() == {1: 100}, env.store.state()

        bad_started = time.monotonic()
        bad = env.rollout(env.spec_file("slow", slow_build), "50,100")
        said = bad.stdout + bad.stderr
        assert bad.returncode != 0 and "failed its canary at 50%" in said and "TTFT p99 vs SLO" in said, said[-3000:]
        assert env.store.traffic() == {1: 100} and env.store.status(3) == "failed", env.store.state()
        tried = env.client.since(bad_started)
        assert 3 in live.shares(tried), (live.shares(tried), [a.detail for a in tried if not a.ok][:5])  # took its share
        env.client.wait_for("answers from r1 alone after the revert",
                            lambda a: live.share_back(a, 1, bad_started) is not None)
        seconds = time.monotonic() - began
        FIGURES.append(
            f"dev-sglang live rollout (pdctl rollout/rollback --pulumi-stack dev, real engine, the fleet's Prometheus "
            f"as prometheus-operator configures it): {len(env.client.since(0))} requests, {sum(not a.ok for a in env.client.since(0))} failed; "
            f"r2 at 50%: {split_shares.get(2, 0):.0%} of {len(split)} answers; rollback r2->r1: command {command:.1f} s, "
            f"live share back at 100% after {back:.1f} s, 0 failed; slow build r3 (TTFT {SLOW_TTFT_MS} ms) stopped at 50% "
            f"and reverted, {sum(not a.ok for a in env.client.since(bad_started))} of "
            f"{len(env.client.since(bad_started))} requests failed from its rollout on; {seconds:.0f} s")
    print(FIGURES[-1])


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-s"]))
