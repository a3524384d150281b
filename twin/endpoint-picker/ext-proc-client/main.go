// Command ext-proc-client plays the gateway's part in front of the endpoint picker, as Envoy's
// ext_proc filter does (github.com/envoyproxy/go-control-plane envoy/service/ext_proc/v3): one
// request's headers, then its whole body, over the picker's ExternalProcessor stream; it prints
// what the picker answered for the request headers (the headers it sets, the destination among
// them, x-gateway-destination-endpoint, gateway-api-inference-extension v1.4.0
// pkg/epp/metadata/consts.go) or its immediate response, as one JSON object.
//
//	ext-proc-client <pod-network socket> <picker ip:port> <path> < body.json
//
// The picker's address is reached through the twin's pod network: the socket's first line names
// the pod address (twin/pods.py). The picker serves TLS with a certificate it makes at start
// (--secure-serving, on by default), which a gateway does not verify either.
package main

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"time"

	configPb "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extProcPb "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
)

type answer struct {
	Headers   map[string]string `json:"headers,omitempty"`
	Immediate *immediate        `json:"immediate,omitempty"`
}

type immediate struct {
	Status int    `json:"status"`
	Body   string `json:"body"`
}

func main() {
	if len(os.Args) != 4 {
		fmt.Fprintln(os.Stderr, "usage: ext-proc-client <pod-network socket> <picker ip:port> <path> < body.json")
		os.Exit(2)
	}
	got, err := pick(os.Args[1], os.Args[2], os.Args[3], os.Stdin)
	if err != nil {
		fmt.Fprintln(os.Stderr, "ext-proc-client:", err)
		os.Exit(1)
	}
	out, _ := json.Marshal(got)
	fmt.Println(string(out))
}

func pick(socket, address, path string, bodyIn io.Reader) (*answer, error) {
	body, err := io.ReadAll(bodyIn)
	if err != nil {
		return nil, err
	}
	dial := func(ctx context.Context, target string) (net.Conn, error) {
		conn, err := (&net.Dialer{}).DialContext(ctx, "unix", socket)
		if err == nil {
			_, err = fmt.Fprintf(conn, "%s\n", target)
		}
		return conn, err
	}
	conn, err := grpc.NewClient("passthrough:///"+address, grpc.WithContextDialer(dial),
		grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{InsecureSkipVerify: true})))
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	stream, err := extProcPb.NewExternalProcessorClient(conn).Process(ctx)
	if err != nil {
		return nil, err
	}
	headers := []*configPb.HeaderValue{
		{Key: ":method", RawValue: []byte("POST")}, {Key: ":path", RawValue: []byte(path)},
		{Key: ":authority", RawValue: []byte(address)}, {Key: ":scheme", RawValue: []byte("http")},
		{Key: "content-type", RawValue: []byte("application/json")},
		{Key: "content-length", RawValue: []byte(fmt.Sprint(len(body)))},
	}
	for _, message := range []*extProcPb.ProcessingRequest{
		{Request: &extProcPb.ProcessingRequest_RequestHeaders{RequestHeaders: &extProcPb.HttpHeaders{
			Headers: &configPb.HeaderMap{Headers: headers}}}},
		{Request: &extProcPb.ProcessingRequest_RequestBody{RequestBody: &extProcPb.HttpBody{
			Body: body, EndOfStream: true}}},
	} {
		if err := stream.Send(message); err != nil {
			return nil, err
		}
	}
	for {
		response, err := stream.Recv()
		if err != nil {
			return nil, fmt.Errorf("the picker's stream: %w", err)
		}
		switch r := response.Response.(type) {
		case *extProcPb.ProcessingResponse_ImmediateResponse:
			return &answer{Immediate: &immediate{int(r.ImmediateResponse.GetStatus().GetCode()), string(r.ImmediateResponse.GetBody())}}, nil
		case *extProcPb.ProcessingResponse_RequestHeaders:
			set := map[string]string{}
			for _, option := range r.RequestHeaders.GetResponse().GetHeaderMutation().GetSetHeaders() {
				value := option.GetHeader().GetValue()
				if raw := option.GetHeader().GetRawValue(); len(raw) > 0 {
					value = string(raw)
				}
				set[option.GetHeader().GetKey()] = value
			}
			_ = stream.CloseSend()
			return &answer{Headers: set}, nil
		}
	}
}
