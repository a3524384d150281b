"""One GitHub OIDC provider per AWS account: IAM holds one OIDC provider per URL in an account
(IAM API reference, CreateOpenIDConnectProvider: EntityAlreadyExists), and every platform stack
made its own, so the second platform stack in an account failed at its first `pulumi up`. Which
stack makes it is now the spec's (`cloud.ci.oidc_provider: create | existing`), and two committed
platform specs in one account that both make it are refused."""

from __future__ import annotations

import json

import pytest
import yaml

from infra.platform_stack.checks import oidc_provider_problems
from infra.platform_stack.program import build_platform, committed_platform_specs
from infra.platform_stack.spec import PlatformSpecError, parse_platform_spec
from infra.render.manifests import unwrap
from tests.conftest import shipped_run

GITHUB = "token.actions.githubusercontent.com"


def prod_data() -> dict:
    return yaml.safe_load(open("stacks/platform-prod.yaml"))


def test_the_committed_platform_specs_make_it_once():
    committed = committed_platform_specs(exclude="")
    makers = [f for f, s in committed.items() if s.cloud.ci and s.cloud.ci.oidc_provider == "create"]
    assert set(committed) >= {"stacks/platform-prod.yaml", "stacks/platform-dev.yaml"}
    assert makers == ["stacks/platform-prod.yaml"]
    for name, spec in committed.items():
        assert oidc_provider_problems(spec, {f: s for f, s in committed.items() if f != name}) == [], name


def test_the_stack_that_makes_it_keeps_it_and_the_other_finds_it():
    """platform-prod makes the provider and keeps it at `pulumi destroy` (platform-dev's CI role
    trusts it); platform-dev makes none and its CI role trusts the one it looks up by URL."""
    prod = shipped_run("platform-prod")
    (made,) = prod.of_type("aws:iam/openIdConnectProvider:OpenIdConnectProvider")
    assert made.inputs["url"] == f"https://{GITHUB}" and made.retain_on_delete
    dev = shipped_run("platform-dev")
    assert dev.of_type("aws:iam/openIdConnectProvider:OpenIdConnectProvider") == []
    (ci,) = [r for r in dev.of_type("aws:iam/role:Role") if r.name == "ci"]
    (statement,) = json.loads(unwrap(ci.inputs)["assumeRolePolicy"])["Statement"]
    assert statement["Principal"]["Federated"] == f"arn:aws:iam::000000000000:oidc-provider/{GITHUB}"


def test_a_second_spec_in_the_account_that_makes_it_is_refused(tmp_path, capsys):
    """A copy of platform-prod for another cluster, also `create`: refused at preview, naming
    the field, the other file and the fix; nothing is registered, no traceback."""
    from infra.cli import main

    data = prod_data()
    data["name"] = "platform-staging"
    data["cloud"]["cluster"]["name"] = "pdstack-staging"
    staging = parse_platform_spec(data)
    with pytest.raises(PlatformSpecError) as refused:
        build_platform(staging)
    assert "cloud.ci.oidc_provider: create, and stacks/platform-prod.yaml" in str(refused.value)
    assert "Fix: set oidc_provider: existing" in str(refused.value)
    path = tmp_path / "platform-staging.yaml"
    path.write_text(yaml.safe_dump(data))
    capsys.readouterr()
    assert main(["preview", "--offline", "--spec", str(path)]) == 2
    err = capsys.readouterr().err
    assert "cloud.ci.oidc_provider" in err and "Traceback" not in err, err


def test_specs_in_named_different_accounts_may_each_make_it():
    data = prod_data()
    data["cloud"]["account_id"] = "111111111111"
    mine = parse_platform_spec(data)
    other = prod_data()
    other["name"] = "platform-other"
    other["cloud"]["account_id"] = "222222222222"
    assert oidc_provider_problems(mine, {"stacks/platform-other.yaml": parse_platform_spec(other)}) == []
    other["cloud"]["account_id"] = "111111111111"
    assert len(oidc_provider_problems(mine, {"stacks/platform-other.yaml": parse_platform_spec(other)})) == 1
    del other["cloud"]["account_id"]  # unnamed: as far as the specs say, the same account
    assert len(oidc_provider_problems(mine, {"stacks/platform-other.yaml": parse_platform_spec(other)})) == 1


def test_ownership_is_said_and_the_account_is_twelve_digits():
    data = prod_data()
    del data["cloud"]["ci"]["oidc_provider"]
    with pytest.raises(PlatformSpecError) as missing:
        parse_platform_spec(data)
    assert any(p.startswith("cloud.aws.ci.oidc_provider") and "Fix:" in p for p in missing.value.problems), \
        missing.value.problems
    data = prod_data()
    data["cloud"]["account_id"] = "1234"
    with pytest.raises(PlatformSpecError) as bad:
        parse_platform_spec(data)
    assert any("account_id" in p and "Fix: its 12 digits" in p for p in bad.value.problems), bad.value.problems


def test_up_in_another_account_than_the_spec_names_is_refused():
    """At `pulumi up` the credentials' account (STS GetCallerIdentity) must be the spec's."""
    from infra.platform_stack.cloud.aws import check_account

    assert check_account("123456789012", "123456789012") == "123456789012"
    with pytest.raises(ValueError, match="cloud.account_id is 123456789012, but the AWS credentials reach account "
                                         "000000000000. Fix:"):
        check_account("123456789012", "000000000000")
