"""The cluster twin: kube-apiserver, kube-controller-manager, kube-scheduler, etcd, kwok, the
LeaderWorkerSet controller and Karpenter (kwok provider), built from the Go modules pinned in
twin/*/go.mod and run on 127.0.0.1, so the rendered fleet meets a real control plane.

    python -m twin build | up | down | status      (make twin-build / twin-up / twin-down)

See README.md, "Cluster twin", for what runs for real and what stands in.
"""
