"""The rank supervisor and its control plane.

    server      a threaded control server: authenticate, dispatch, survive bad peers
(the per-job secret lives with the job folder: cluster/jobdir.py; the messages: protocol/messages.py)
"""
