"""The rank supervisor and its control plane.

    secret      the per-job secret (0600 file in the job folder)
    server      a threaded control server: authenticate, dispatch, survive bad peers
"""
