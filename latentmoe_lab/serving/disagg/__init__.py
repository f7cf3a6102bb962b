"""Prefill/decode disaggregation as a service (docs/design.md §13.2): instance processes and the router.

The rows themselves move through serving/transport/; this package runs the processes around them.

    section.py          the disaggregation: section -> each role's instance config
    instance.py         one Engine in its own process, with a role (prefill or decode)
    channel.py          framed messages over a Unix socket pair, router <-> instance
    instance_handle.py  the router's handle of one instance: process, channel, outbox
    router_request.py   a request as the router sees it, and the events it hands back
    router.py           DisaggRouter: a request's way prefill -> payload -> decode, and faults
"""
