// Command helm-template renders a chart's templates as `helm template` does, with the Helm
// library at the version the pinned Kubernetes provider embeds (engine/kubernetes/go.mod:
// helm.sh/helm/v3 v3.18.6), for the twin to read a controller's RBAC from its own chart and to
// render the platform's charts with the values the platform stack gives them.
//
//	helm-template [-values file] [-kube-version v1.34.0] <chart folder> <release name> <namespace>
//
// Writes every rendered template, each document headed "# Source: <template path>" as Helm's
// does, to stdout. Values are the chart's own defaults, coalesced with the values file when one
// is given (YAML or JSON, as `helm template -f` reads it: chartutil.ReadValuesFile, then
// chartutil.ToRenderValues merges maps and replaces everything else). The Kubernetes version
// templates see (.Capabilities.KubeVersion) is Helm's built-in default (v1.20.0) unless
// -kube-version says the cluster's, as `helm template --kube-version` does; a chart that picks an
// API version by it (Karpenter's PodDisruptionBudget) needs the cluster's.
package main

import (
	"flag"
	"fmt"
	"os"
	"sort"
	"strings"

	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/engine"
)

func main() {
	valuesFile := flag.String("values", "", "a values file (YAML or JSON) over the chart's defaults")
	kubeVersion := flag.String("kube-version", "", "the Kubernetes version templates see (default Helm's)")
	flag.Parse()
	if flag.NArg() != 3 {
		fmt.Fprintln(os.Stderr, "usage: helm-template [-values file] [-kube-version v1.34.0] <chart folder> <release name> <namespace>")
		os.Exit(2)
	}
	if err := render(flag.Arg(0), flag.Arg(1), flag.Arg(2), *valuesFile, *kubeVersion); err != nil {
		fmt.Fprintln(os.Stderr, "helm-template:", err)
		os.Exit(1)
	}
}

func render(folder, release, namespace, valuesFile, kubeVersion string) error {
	chart, err := loader.Load(folder)
	if err != nil {
		return err
	}
	given := chartutil.Values{}
	if valuesFile != "" {
		if given, err = chartutil.ReadValuesFile(valuesFile); err != nil {
			return err
		}
	}
	capabilities := chartutil.DefaultCapabilities.Copy()
	if kubeVersion != "" {
		version, err := chartutil.ParseKubeVersion(kubeVersion)
		if err != nil {
			return fmt.Errorf("-kube-version %q: %w", kubeVersion, err)
		}
		capabilities.KubeVersion = *version
	}
	options := chartutil.ReleaseOptions{Name: release, Namespace: namespace, Revision: 1, IsInstall: true}
	values, err := chartutil.ToRenderValues(chart, given, options, capabilities)
	if err != nil {
		return err
	}
	rendered, err := engine.Render(chart, values)
	if err != nil {
		return err
	}
	names := make([]string, 0, len(rendered))
	for name, text := range rendered {
		if strings.TrimSpace(text) != "" && !strings.HasSuffix(name, "NOTES.txt") {
			names = append(names, name)
		}
	}
	sort.Strings(names)
	for _, name := range names {
		fmt.Printf("---\n# Source: %s\n%s\n", name, rendered[name])
	}
	return nil
}
