"""The job's protocol, defined once: everything two processes of a job agree on.

    keys          every key of the job's TCPStore (the coordinator <-> worker data plane of control)
    signed_store  the job's store with every key hidden and every value signed under the job secret
    wire          authenticated JSON frames of the control plane (supervisor <-> agents, CLI)
    messages      the control plane's messages, one type each, validated where they are received
    events        the event log (`events.jsonl`): writer, readers
    event_schema  one typed event per kind: what `emit` accepts and `read_event` returns
    timeouts      every timeout and poll period of the job's processes (`JobTimeouts.from_recipe`)
"""
