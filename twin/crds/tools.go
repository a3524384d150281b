//go:build tools

// Package crds keeps each CRD-carrying module in go.mod and go.sum (see go.mod).
package crds

import (
	_ "github.com/aws/karpenter-provider-aws/pkg/apis"
	_ "github.com/envoyproxy/gateway/api/v1alpha1"
	_ "github.com/kedacore/keda/v2/apis/keda/v1alpha1"
	_ "github.com/prometheus-operator/prometheus-operator/pkg/versionutil"
	_ "sigs.k8s.io/gateway-api-inference-extension/api/v1"
	_ "sigs.k8s.io/gateway-api/apis/v1"
)
