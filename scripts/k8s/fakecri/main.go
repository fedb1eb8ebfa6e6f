// Command fakecri serves the kubelet's own fake container runtime
// (k8s.io/kubernetes/pkg/kubelet/cri/remote/fake) on a Unix socket, for gpupool's end-to-end
// tests on a real control plane. No container process runs (the containers are simulated):
// pods reach Running on their own. It records every container the kubelet creates (its pod,
// environment, mounts and device nodes, which is where the device plugin's Allocate answer
// ends up) as one JSON file in -record-dir, so the tests can read what a container would
// have started with. `kubectl exec` runs the command as a plain host process (no isolation
// at all) with the container's environment, through the kubelet's own streaming server.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"io"
	"os/exec"
	"os/signal"
	"path/filepath"
	"sync"
	"syscall"

	"google.golang.org/grpc"
	"k8s.io/client-go/tools/remotecommand"
	kubeapi "k8s.io/cri-api/pkg/apis/runtime/v1alpha2"
	"k8s.io/kubernetes/pkg/kubelet/cri/remote/fake"
	"k8s.io/kubernetes/pkg/kubelet/cri/remote/util"
	"k8s.io/kubernetes/pkg/kubelet/cri/streaming"
	utilexec "k8s.io/utils/exec"
)

type mount struct {
	ContainerPath string `json:"container_path"`
	HostPath      string `json:"host_path"`
	ReadOnly      bool   `json:"read_only"`
}

type device struct {
	ContainerPath string `json:"container_path"`
	HostPath      string `json:"host_path"`
	Permissions   string `json:"permissions"`
}

type record struct {
	Namespace string            `json:"namespace"`
	Pod       string            `json:"pod"`
	PodUID    string            `json:"pod_uid"`
	Container string            `json:"container"`
	Attempt   uint32            `json:"attempt"`
	Env       map[string]string `json:"env"`
	Mounts    []mount           `json:"mounts"`
	Devices   []device          `json:"devices"`
}

// recording is the fake runtime with CreateContainer writing down what it was given.
type recording struct {
	*fake.RemoteRuntime
	dir    string
	stream streaming.Server
	mu     sync.Mutex
	envs   map[string][]string // container id -> its environment, for exec
}

func (r *recording) CreateContainer(ctx context.Context, req *kubeapi.CreateContainerRequest) (*kubeapi.CreateContainerResponse, error) {
	resp, err := r.RemoteRuntime.CreateContainer(ctx, req)
	if err != nil {
		return nil, err
	}
	pod := req.GetSandboxConfig().GetMetadata()
	rec := record{
		Namespace: pod.GetNamespace(),
		Pod:       pod.GetName(),
		PodUID:    pod.GetUid(),
		Container: req.GetConfig().GetMetadata().GetName(),
		Attempt:   req.GetConfig().GetMetadata().GetAttempt(),
		Env:       map[string]string{},
		Mounts:    []mount{},
		Devices:   []device{},
	}
	for _, kv := range req.GetConfig().GetEnvs() {
		rec.Env[kv.Key] = kv.Value
	}
	for _, m := range req.GetConfig().GetMounts() {
		rec.Mounts = append(rec.Mounts, mount{m.ContainerPath, m.HostPath, m.Readonly})
	}
	for _, d := range req.GetConfig().GetDevices() {
		rec.Devices = append(rec.Devices, device{d.ContainerPath, d.HostPath, d.Permissions})
	}
	if err := r.write(rec); err != nil {
		return nil, err
	}
	env := []string{}
	for k, v := range rec.Env {
		env = append(env, k+"="+v)
	}
	r.mu.Lock()
	r.envs[resp.ContainerId] = env
	r.mu.Unlock()
	return resp, nil
}

// Exec hands the kubelet a URL of the streaming server, as a real runtime does.
func (r *recording) Exec(ctx context.Context, req *kubeapi.ExecRequest) (*kubeapi.ExecResponse, error) {
	return r.stream.GetExec(req)
}

// streamRuntime runs exec'd commands on the host with the container's environment.
type streamRuntime struct{ rec *recording }

func (s streamRuntime) Exec(containerID string, cmd []string, in io.Reader, out, errw io.WriteCloser, tty bool, resize <-chan remotecommand.TerminalSize) error {
	if len(cmd) == 0 {
		return fmt.Errorf("no command")
	}
	s.rec.mu.Lock()
	env, ok := s.rec.envs[containerID]
	s.rec.mu.Unlock()
	if !ok {
		return fmt.Errorf("container %s is not known", containerID)
	}
	c := exec.Command(cmd[0], cmd[1:]...)
	c.Env = append([]string{"PATH=/usr/local/bin:/usr/bin:/bin"}, env...)
	c.Dir = os.TempDir()
	c.Stdin, c.Stdout, c.Stderr = in, out, errw
	if err := c.Run(); err != nil {
		if exit, ok := err.(*exec.ExitError); ok {
			return &utilexec.CodeExitError{Err: err, Code: exit.ExitCode()}
		}
		return err
	}
	return nil
}

func (s streamRuntime) Attach(containerID string, in io.Reader, out, errw io.WriteCloser, tty bool, resize <-chan remotecommand.TerminalSize) error {
	return fmt.Errorf("attach: simulated containers have no process")
}

func (s streamRuntime) PortForward(podSandboxID string, port int32, stream io.ReadWriteCloser) error {
	return fmt.Errorf("port-forward: simulated containers listen on nothing")
}

// write puts the record in place atomically: a reader sees a whole file or none.
func (r *recording) write(rec record) error {
	data, err := json.MarshalIndent(rec, "", "  ")
	if err != nil {
		return err
	}
	name := fmt.Sprintf("%s_%s_%s_%d.json", rec.Namespace, rec.Pod, rec.Container, rec.Attempt)
	tmp := filepath.Join(r.dir, "."+name+".tmp")
	if err := os.WriteFile(tmp, data, 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, filepath.Join(r.dir, name))
}

func main() {
	endpoint := flag.String("endpoint", "", "Unix socket to serve the CRI on (unix:///path)")
	dir := flag.String("record-dir", "", "directory for one JSON file per created container")
	streamAddr := flag.String("stream-addr", "127.0.0.1:10350", "address of the exec streaming server")
	flag.Parse()
	if *endpoint == "" || *dir == "" {
		fmt.Fprintln(os.Stderr, "fakecri: -endpoint and -record-dir are required")
		os.Exit(2)
	}
	if err := os.MkdirAll(*dir, 0o700); err != nil {
		fmt.Fprintln(os.Stderr, "fakecri:", err)
		os.Exit(1)
	}
	runtime := fake.NewFakeRemoteRuntime()
	runtime.RuntimeService.FakeStatus = &kubeapi.RuntimeStatus{
		Conditions: []*kubeapi.RuntimeCondition{
			{Type: kubeapi.RuntimeReady, Status: true},
			{Type: kubeapi.NetworkReady, Status: true},
		},
	}
	// A pulled image needs a size, or the kubelet refuses to start its containers.
	runtime.ImageService.SetFakeImageSize(1 << 20)
	rec := &recording{RemoteRuntime: runtime, dir: *dir, envs: map[string][]string{}}
	config := streaming.DefaultConfig
	config.Addr = *streamAddr
	stream, err := streaming.NewServer(config, streamRuntime{rec})
	if err != nil {
		fmt.Fprintln(os.Stderr, "fakecri:", err)
		os.Exit(1)
	}
	rec.stream = stream
	go func() {
		if err := stream.Start(true); err != nil {
			fmt.Fprintln(os.Stderr, "fakecri: streaming server:", err)
			os.Exit(1)
		}
	}()
	server := grpc.NewServer()
	kubeapi.RegisterRuntimeServiceServer(server, rec)
	kubeapi.RegisterImageServiceServer(server, rec)
	listener, err := util.CreateListener(*endpoint)
	if err != nil {
		fmt.Fprintln(os.Stderr, "fakecri:", err)
		os.Exit(1)
	}
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		<-stop
		server.Stop()
	}()
	fmt.Println("fakecri: serving on", *endpoint)
	if err := server.Serve(listener); err != nil {
		fmt.Fprintln(os.Stderr, "fakecri:", err)
		os.Exit(1)
	}
}
