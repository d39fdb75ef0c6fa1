// AOTInductor's model runner for spyre: what `torch._inductor.aoti_load_package`
// constructs for a package whose metadata names the spyre device.
//
// AOTInductor picks a runner by the package's device key from a registry
// (`RegisterAOTIModelRunner`, its public extension point); a device whose
// compiled model is not AOTInductor's C++ container default-constructs the
// base runner and overrides `run_impl` (what the base class documents for
// custom devices).  The package's model library holds the spyre wrapper
// module (the planned kernel programs and their launch sequence) and the
// weights (compiler/aoti.py); torch_spyre.runtime.aoti loads them and runs
// the graph through the one launcher.  This file only crosses from
// AOTInductor's C++ interface to that Python object.
#include <torch/csrc/inductor/aoti_runner/model_container_runner.h>
#include <torch/csrc/inductor/aoti_torch/tensor_converter.h>

#include "runtime.h"

namespace spyre {
namespace {

class SpyreAOTIRunner final : public torch::inductor::AOTIModelContainerRunner {
 public:
  SpyreAOTIRunner(const std::string& so_path, const std::string& device_str,
                  const std::string& model_dir) {
    py::gil_scoped_acquire gil;
    model_ = py::module_::import("torch_spyre.runtime.aoti")
                 .attr("load")(so_path, device_str, model_dir);
    auto spec = model_.attr("call_spec").cast<std::vector<std::string>>();
    TORCH_CHECK(spec.size() == 2, "spyre AOTI model: call_spec must be [in, out]");
    in_spec_ = spec[0];
    out_spec_ = spec[1];
    // get_call_spec() of the base reads the spec through this function
    // pointer with the container handle: both are ours.
    container_handle_ = reinterpret_cast<AOTInductorModelContainerHandle>(this);
    get_call_spec_func_ = &SpyreAOTIRunner::call_spec;
  }

  ~SpyreAOTIRunner() override {
    if (!Py_IsInitialized()) {
      model_.release();  // the interpreter is gone: nothing left to free
      return;
    }
    py::gil_scoped_acquire gil;
    model_ = py::object();
  }

 protected:
  std::vector<at::Tensor> run_impl(std::vector<AtenTensorHandle>& input_handles,
                                   void* /*stream_handle*/) override {
    auto inputs = torch::aot_inductor::alloc_tensors_by_stealing_from_handles(
        input_handles.data(), input_handles.size());
    py::gil_scoped_acquire gil;
    return model_.attr("run")(inputs).cast<std::vector<at::Tensor>>();
  }

 private:
  static AOTIRuntimeError call_spec(AOTInductorModelContainerHandle handle,
                                    const char** in_spec, const char** out_spec) {
    auto* self = reinterpret_cast<SpyreAOTIRunner*>(handle);
    *in_spec = self->in_spec_.c_str();
    *out_spec = self->out_spec_.c_str();
    return AOTI_RUNTIME_SUCCESS;
  }

  py::object model_;
  std::string in_spec_, out_spec_;
};

std::unique_ptr<torch::inductor::AOTIModelContainerRunner> create_runner(
    const std::string& so_path, size_t /*num_models*/, const std::string& device_str,
    const std::string& model_dir, const bool /*run_single_threaded*/) {
  return std::make_unique<SpyreAOTIRunner>(so_path, device_str, model_dir);
}

const torch::inductor::RegisterAOTIModelRunner register_spyre_runner("spyre", &create_runner);

}  // namespace
}  // namespace spyre
