// Command helm-template renders a chart's templates as `helm template` does, with the Helm
// library at the version the pinned Kubernetes provider embeds (engine/kubernetes/go.mod:
// helm.sh/helm/v3 v3.18.6), for the twin to read a controller's RBAC from its own chart.
//
//	helm-template <chart folder> <release name> <namespace>
//
// Writes every rendered template, each document headed "# Source: <template path>" as Helm's
// does, to stdout; values are the chart's own defaults (the twin sets none).
package main

import (
	"fmt"
	"os"
	"sort"
	"strings"

	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/engine"
)

func main() {
	if len(os.Args) != 4 {
		fmt.Fprintln(os.Stderr, "usage: helm-template <chart folder> <release name> <namespace>")
		os.Exit(2)
	}
	if err := render(os.Args[1], os.Args[2], os.Args[3]); err != nil {
		fmt.Fprintln(os.Stderr, "helm-template:", err)
		os.Exit(1)
	}
}

func render(folder, release, namespace string) error {
	chart, err := loader.Load(folder)
	if err != nil {
		return err
	}
	options := chartutil.ReleaseOptions{Name: release, Namespace: namespace, Revision: 1, IsInstall: true}
	values, err := chartutil.ToRenderValues(chart, map[string]interface{}{}, options, chartutil.DefaultCapabilities)
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
