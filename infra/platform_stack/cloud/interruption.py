"""Karpenter's interruption queue: an SQS queue the EventBridge rules fill with the EC2 and AWS
Health events that end or threaten a node, which Karpenter reads (its chart's
settings.interruptionQueue) to drain the node before EC2 takes it.

The events are those the pinned controller parses (karpenter-provider-aws v1.14.1
pkg/controllers/interruption/parser.go DefaultParsers, each parser's Source() and DetailType() in
pkg/controllers/interruption/messages/*/parser.go): an event of any other source or detail type is
deleted unread, so a rule for one would only cost. Where a parser drops events by their detail
(a state change to a state it does not act on, a Health event of another service or category),
the rule's pattern drops them first.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws


@dataclass(frozen=True)
class InterruptionRule:
    name: str
    source: str
    detail_type: str
    detail: dict | None = None  # the parser's own filter on the event's detail, as a pattern

    def pattern(self) -> dict:
        found = {"source": [self.source], "detail-type": [self.detail_type]}
        if self.detail:
            found["detail"] = self.detail
        return found


# statechange/parser.go acceptedStates; scheduledchange/parser.go acceptedService, acceptedEventTypeCategory.
INSTANCE_STATES = ("stopping", "stopped", "shutting-down", "terminated")
RULES = (
    InterruptionRule("spot-interruption", "aws.ec2", "EC2 Spot Instance Interruption Warning"),
    InterruptionRule("rebalance", "aws.ec2", "EC2 Instance Rebalance Recommendation"),
    InterruptionRule("instance-state-change", "aws.ec2", "EC2 Instance State-change Notification",
                     {"state": list(INSTANCE_STATES)}),
    InterruptionRule("scheduled-change", "aws.health", "AWS Health Event",
                     {"service": ["EC2"], "eventTypeCategory": ["scheduledChange"]}),
    # A capacity reservation (the prod pools') taking its instances back.
    InterruptionRule("capacity-reservation-interruption", "aws.ec2",
                     "EC2 Capacity Reservation Instance Interruption Warning"),
)


def interruption_queue_name(cluster: str) -> str:
    """The queue's name: SQS allows 80 letters, digits, '-' and '_' (SQS Developer Guide, "Amazon
    SQS queue quotas"); a cluster name is a DNS label of 63 at most, so this fits."""
    return f"{cluster}-interruption"


def interruption_queue_arn(region: str, account: str, cluster: str) -> str:
    return f"arn:aws:sqs:{region}:{account}:{interruption_queue_name(cluster)}"


def karpenter_queue_statement(region: str, account: str, cluster: str) -> dict:
    """What the controller calls on the queue (pkg/aws/sdk.go SQSAPI; pkg/providers/sqs): its URL
    by name, then receive and delete, on this queue only."""
    return {"Effect": "Allow", "Action": ["sqs:GetQueueUrl", "sqs:ReceiveMessage", "sqs:DeleteMessage"],
            "Resource": interruption_queue_arn(region, account, cluster)}


def queue_policy(queue_arn: str) -> str:
    """EventBridge and SQS may send to the queue, nothing reads it over plain HTTP: the statements
    of Karpenter's getting-started template (KarpenterInterruptionQueuePolicy). EventBridge
    delivers to SQS under the queue's resource policy (EventBridge User Guide, "Amazon SQS
    permissions")."""
    return json.dumps({"Version": "2012-10-17", "Statement": [
        {"Sid": "EventBridgeSends", "Effect": "Allow",
         "Principal": {"Service": ["events.amazonaws.com", "sqs.amazonaws.com"]},
         "Action": "sqs:SendMessage", "Resource": queue_arn},
        {"Sid": "TLSOnly", "Effect": "Deny", "Principal": "*", "Action": "sqs:*", "Resource": queue_arn,
         "Condition": {"Bool": {"aws:SecureTransport": "false"}}}]}, sort_keys=True)


def interruption_queue(cluster: str, region: str, account: pulumi.Output, opts: pulumi.ResourceOptions
                       ) -> list[pulumi.Resource]:
    """The queue, its policy, and one rule with its target per event kind: what Karpenter's
    controller needs before it starts (it looks the queue up at start) and after it stops. The
    rules are named by Pulumi (the logical name and a suffix): EventBridge allows 64 characters,
    too few for a cluster's name and the kind's."""
    queue = aws.sqs.Queue("karpenter-interruption", name=interruption_queue_name(cluster),
                          # an event older than the two-minute Spot notice is of no use
                          message_retention_seconds=300, sqs_managed_sse_enabled=True, opts=opts)
    # From the queue's name (an edge to it): the ARN SQS gives it (SQS Developer Guide, resource ARNs).
    queue_arn = pulumi.Output.all(queue.name, account).apply(lambda a: f"arn:aws:sqs:{region}:{a[1]}:{a[0]}")
    made: list[pulumi.Resource] = [queue, aws.sqs.QueuePolicy("karpenter-interruption", queue_url=queue.url,
                                                              policy=queue_arn.apply(queue_policy), opts=opts)]
    for rule in RULES:
        event_rule = aws.cloudwatch.EventRule(f"karpenter-{rule.name}", description=f"Karpenter of {cluster}: "
                                              f"{rule.detail_type}", event_pattern=json.dumps(rule.pattern(), sort_keys=True),
                                              opts=opts)
        made += [event_rule, aws.cloudwatch.EventTarget(f"karpenter-{rule.name}", rule=event_rule.name,
                                                        arn=queue_arn, opts=opts)]
    return made
